#!/usr/bin/env bash
# Installs the real SGLang (one pinned release) into a venv of its own on a CPU-only x86-64
# machine, so `python -m sglang.launch_server --device cpu` serves a tiny HF model here. A plain
# `pip install sglang` cannot do that: its declared dependencies are CUDA builds (torch 2.14.1,
# sglang-kernel, flashinfer, ~5 GB). What this does instead:
#   1. python3.11 -m venv, then torch 2.13.0+cpu (the machine's local CPU wheel);
#   2. sglang with --no-deps, then only the dependencies that its server imports on the CPU path,
#      under a constraints file that holds torch at 2.13.0+cpu (pip can never swap in a CUDA torch);
#   3. the CPU shims of scripts/sglang_cpu/ copied into the venv's site-packages: a pure-Python
#      `sgl_kernel` and a start-up hook that lets the registry's (CUDA) torchvision import;
#   4. an import check of SGLang's HTTP server, then a marker file recording what was installed.
# Idempotent: when the marker matches, the venv's shims are this checkout's and the installed
# versions are the pinned ones, it only says so (< 1 s; the import check of step 4 takes 10-20 s
# on 2 cores, so it runs only after an install). Otherwise it (re)runs every step, each a no-op for
# what is already in place. It writes nothing into the repository. Progress goes to stderr; the
# last line on stdout is the venv's python. ~2.3 GB; ~2 min on 2 cores (most wheels are local).
#
#   scripts/install_sglang_cpu.sh                 # venv at ~/.cache/megatron-earl/sglang-0.5.23
#   EARL_SGLANG_VENV=/path/to/venv scripts/install_sglang_cpu.sh
#   PY=$(scripts/install_sglang_cpu.sh)
#   SGLANG_USE_CPU_ENGINE=1 $PY -m sglang.launch_server --model-path DIR --device cpu \
#       --attention-backend torch_native --disable-cuda-graph --dtype float32 \
#       --max-total-tokens 4096 --skip-server-warmup --host 127.0.0.1 --port P
# SGLANG_USE_CPU_ENGINE=1 is required (without it --device cpu still takes GPU code paths); cap
# the KV pool (--max-total-tokens) or SGLang sizes it from the machine's free RAM. --tp-size 2
# (gloo) also needs SGLANG_CPU_OMP_THREADS_BIND='0|1' (the cores of each rank) on a one-NUMA-node
# machine.
set -euo pipefail

SGLANG_VERSION=0.5.23  # = SGLANG_PINNED (megatron_earl/rollout/sglang/client.py)
TORCH_VERSION=2.13.0+cpu
TORCHVISION_VERSION=0.28.0  # the one built against torch 2.13.0
VENV=${EARL_SGLANG_VENV:-$HOME/.cache/megatron-earl/sglang-$SGLANG_VERSION}
SHIMS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/sglang_cpu"
PY="$VENV/bin/python"
MARKER="$VENV/earl-sglang-install.txt"
CONSTRAINTS="$VENV/earl-constraints.txt"
EXPECTED="sglang==$SGLANG_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION"

# What SGLang's server imports on this path (found by importing and starting it), with the
# pins SGLang declares where it declares one. Left out of SGLang's list: the CUDA-only packages
# (sglang-kernel, flashinfer, flash-attn-4, cuda-python, torchaudio, torchcodec, ...) and those
# only features not used here import (outlines, llguidance, openai-harmony for /v1/responses,
# mistral_common, timm, modelscope, datasets, numba, scipy, ...).
DEPS=(
    # the HTTP server, its processes and their messages
    fastapi "uvicorn>=0.51" uvloop "pyzmq>=25.1.2" orjson msgspec pybase64 psutil setproctitle
    aiohttp pydantic python-multipart "prometheus-client>=0.20.0" requests packaging tqdm regex
    numpy
    # the model and its tokenizer
    "transformers==5.19.0" "tokenizers==0.23.2" safetensors "sentencepiece==0.2.1"
    # imported at module level on the way, never called for a dense model on CPU (triton imports
    # without a GPU; dill and jsonschema are what SGLang gets through packages left out above)
    "triton==3.7.1" "torchvision==$TORCHVISION_VERSION" "apache-tvm-ffi==0.1.11"
    "compressed-tensors==0.18.0" gguf "openai==2.8.0" partial_json_parser einops jsonschema
    "xgrammar==0.2.7" "soundfile==0.13.1" ipython dill
)

say() { echo "install_sglang_cpu: $*" >&2; }

# pip, its output on stderr without two kinds of expected noise: this machine's local indexes
# lacking a project ("Location ... is ignored"), and the resolver listing SGLang's CUDA pins as
# unmet (those are checked once, at the end, by `pip check`).
pip_install() {
    "$PY" -m pip install --progress-bar off "$@" 2>&1 \
        | sed -e '/is ignored: it is neither a file nor a directory/d' \
              -e "/^sglang $SGLANG_VERSION requires /d" \
              -e "/^ERROR: pip's dependency resolver does not currently take into account/d" >&2
}

shims_installed() {  # the venv's shims are byte-identical to this checkout's
    local site=$1
    diff -rq -x __pycache__ "$SHIMS/sgl_kernel" "$site/sgl_kernel" >/dev/null 2>&1 &&
        cmp -s "$SHIMS/earl_torchvision_schemas.py" "$site/earl_torchvision_schemas.py" &&
        cmp -s "$SHIMS/earl_torchvision_schemas.pth" "$site/earl_torchvision_schemas.pth"
}

versions_installed() {  # installed distributions match, read from metadata (no torch import)
    "$PY" - "$SGLANG_VERSION" "$TORCH_VERSION" "$TORCHVISION_VERSION" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version

want = dict(zip(("sglang", "torch", "torchvision"), sys.argv[1:]))
sys.exit(any(version(name) != v for name, v in want.items()))
PY
}

site_packages() { "$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }

if [[ -x "$PY" && -f "$MARKER" && "$(cat "$MARKER")" == "$EXPECTED" ]] &&
    shims_installed "$(site_packages)" && versions_installed; then
    say "$EXPECTED with the CPU shims is already installed in $VENV: nothing to do"
    echo "$PY"
    exit 0
fi

if ! command -v python3.11 >/dev/null; then
    say "python3.11 not found on PATH (SGLang $SGLANG_VERSION's venv is built with it)"
    exit 1
fi
start=$SECONDS
say "installing $EXPECTED into $VENV"
rm -f "$MARKER"
[[ -x "$PY" ]] || python3.11 -m venv "$VENV"
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" > "$CONSTRAINTS"

say "1/4 torch $TORCH_VERSION"
pip_install -q -c "$CONSTRAINTS" torch
say "2/4 sglang $SGLANG_VERSION (--no-deps) and the dependencies its CPU server imports"
pip_install -q --no-deps "sglang==$SGLANG_VERSION"
pip_install -q -c "$CONSTRAINTS" "${DEPS[@]}"

say "3/4 CPU shims from $SHIMS"
SITE=$(site_packages)
rm -rf "$SITE/sgl_kernel"
cp -r "$SHIMS/sgl_kernel" "$SITE/sgl_kernel"
cp "$SHIMS/earl_torchvision_schemas.py" "$SHIMS/earl_torchvision_schemas.pth" "$SITE/"

say "4/4 import check (SGLang's HTTP server, as the launch imports it)"
LOG="$VENV/earl-import-check.log"
if ! SGLANG_USE_CPU_ENGINE=1 "$PY" -c "import sglang, sgl_kernel, torchvision.transforms; \
import sglang.srt.entrypoints.http_server" > "$LOG" 2>&1; then
    tail -n 20 "$LOG" >&2
    say "the import check failed (full output in $LOG)"
    exit 1
fi
unmet=$("$PY" -m pip check 2>/dev/null | grep -v "^sglang $SGLANG_VERSION " || true)
if [[ -n "$unmet" ]]; then
    say "pip check reports conflicts beyond SGLang's own (CUDA) pins:"
    echo "$unmet" >&2
fi
echo "$EXPECTED" > "$MARKER"
say "done in $(( SECONDS - start )) s; venv $(du -sh "$VENV" | cut -f1)"
echo "$PY"
