#!/usr/bin/env bash
# HF safetensors -> Megatron torch_dist checkpoint (one process; loads in any layout afterwards).
#
#   scripts/convert_hf_to_mcore.sh HF_DIR OUT_DIR [--tp 2 --pp 2 --dtype bfloat16 ...]
#   sbatch -N1 -n1 --cpus-per-task=8 --wrap "scripts/convert_hf_to_mcore.sh hf/Qwen2.5-7B ckpt/q7b"
#
# --tp/--pp/--vpp only check that the model splits that way. The converter streams one layer at a
# time (memory: about two layers plus the embeddings) and writes OUT_DIR.tmp-<pid> first, renaming
# it to OUT_DIR when complete. Environment: PYTHON (default python).
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: $0 HF_DIR OUT_DIR [--tp N] [--pp N] [--vpp N] [--dtype float32|bfloat16|float16]" \
        "[--make-vocab-size-divisible-by N]" >&2
    exit 2
fi
HF_DIR=$1 OUT_DIR=$2
shift 2
exec "${PYTHON:-python}" -m megatron_earl.convert.cli hf-to-mcore --hf "$HF_DIR" --out "$OUT_DIR" "$@"
