#!/usr/bin/env bash
# GPU smoke test for a machine with NVIDIA GPUs: install the GPU extras, check the GPUs, run the
# GPU test tier (tests/gpu, pytest -m gpu) and the demo on N GPUs. Exits non-zero on any failure.
#
#   scripts/gpu_smoke.sh                       # N = every GPU nvidia-smi lists
#   NGPUS=2 scripts/gpu_smoke.sh steps=5       # extra key=value overrides go to the demo
#
# Environment: NGPUS (default: the GPUs nvidia-smi lists), PYTHON (default python), EXTRAS (pip
# extras, default "te,dev"), TORCH (the torch installed first, default 2.14.1: SGLang 0.5.23's pin;
# Transformer Engine's torch part compiles against the installed torch, so the extras install
# without build isolation; docs/install.md), EARL_SKIP_INSTALL=1 skips the pip install,
# DEMO_STEPS (RL steps of the demo, default 3), OUTPUT_DIR (default runs). Nothing in this project
# has run on a real GPU yet (README "On GPUs"): this script is how a GPU user checks the claims.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
EXTRAS=${EXTRAS:-te,dev}
TORCH=${TORCH:-2.14.1}
DEMO_STEPS=${DEMO_STEPS:-3}
OUTPUT_DIR=${OUTPUT_DIR:-runs}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_smoke.sh: nvidia-smi not found: this script needs NVIDIA GPUs and their driver" >&2
    exit 2
fi
found=$(nvidia-smi --list-gpus | grep -c '^GPU ' || true)
NGPUS=${NGPUS:-$found}
if [[ ! $NGPUS =~ ^[1-9][0-9]*$ ]] || (( NGPUS > found )); then
    echo "gpu_smoke.sh: NGPUS=$NGPUS but nvidia-smi lists $found GPU(s); valid: 1..$found" >&2
    exit 2
fi
nvidia-smi

if [[ "${EARL_SKIP_INSTALL:-0}" != 1 ]]; then
    "$PYTHON" -m pip install "torch==$TORCH" packaging wheel
    "$PYTHON" -m pip install --no-build-isolation -e ".[$EXTRAS]"
fi
"$PYTHON" - "$NGPUS" <<'PY'
import sys

import torch

need, seen = int(sys.argv[1]), torch.cuda.device_count()
if seen < need:
    sys.exit(f"gpu_smoke.sh: torch {torch.__version__} sees {seen} CUDA device(s), need {need}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}: {seen} device(s)")
PY

echo "== GPU tests (tests/gpu) =="
"$PYTHON" -m pytest -q -rs -m gpu tests/gpu

echo "== demo on $NGPUS GPU(s) =="
layouts=()
if (( NGPUS != 2 )); then  # configs/demo_cpu.yaml is laid out for 2 ranks
    layouts=("layouts.rollout=tp1cp1pp1dp$NGPUS" "layouts.experience=tp1cp1pp1dp$NGPUS"
             "layouts.train=tp1cp1pp1dp$NGPUS")
fi
"$PYTHON" -m megatron_earl.cli.main train --nproc "$NGPUS" --config configs/demo_cpu.yaml \
    "steps=$DEMO_STEPS" "output_dir=$OUTPUT_DIR" "name=gpu_smoke_${NGPUS}gpu" \
    "${layouts[@]}" "$@"

echo "gpu_smoke.sh: OK on $NGPUS GPU(s)"
