#!/usr/bin/env bash
# Local launcher: one machine (CPU, or the GPUs of one node), torchrun standalone.
#
#   scripts/train_local.sh [CONFIG] [key=value ...]
#   scripts/train_local.sh configs/demo_cpu.yaml steps=5 train.lr=1e-4
#   NPROC=8 scripts/train_local.sh configs/qwen2.5-7b_grpo.yaml
#
# Environment: NPROC (processes, default 2), OMP_NUM_THREADS (default: cores / NPROC),
# PYTHON (default python), TORCHRUN (default torchrun), EARL_SKIP_CHECK=1 skips the pre-flight
# config check. The config is validated for NPROC ranks before any process starts.
set -euo pipefail

CONFIG=${1:-configs/demo_cpu.yaml}
[[ $# -gt 0 ]] && shift
NPROC=${NPROC:-2}
PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-torchrun}

if [[ ! -f "$CONFIG" ]]; then
    echo "train_local.sh: config file '$CONFIG' does not exist" >&2
    exit 2
fi
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    cores=$(nproc 2>/dev/null || echo 1)
    OMP_NUM_THREADS=$(( cores / NPROC > 0 ? cores / NPROC : 1 ))
fi
export OMP_NUM_THREADS

if [[ "${EARL_SKIP_CHECK:-0}" != 1 ]]; then
    "$PYTHON" -m megatron_earl.cli.check --world-size "$NPROC" --config "$CONFIG" "$@"
fi

exec "$TORCHRUN" --standalone --nnodes=1 --nproc-per-node="$NPROC" \
    -m megatron_earl.cli.train --config "$CONFIG" "$@"
