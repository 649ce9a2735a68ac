#!/usr/bin/env bash
# Megatron torch_dist checkpoint -> HF safetensors (sharded, with index) + config.json.
#
#   scripts/convert_mcore_to_hf.sh CKPT OUT_DIR [--hf-config HF_DIR] [--max-shard-size 5GB]
#   scripts/convert_mcore_to_hf.sh runs/grpo/checkpoints hf/policy --hf-config hf/Qwen2.5-7B
#
# CKPT is a checkpoint directory or a run's checkpoint directory (its 'latest' is followed); any
# layout it was saved in. --hf-config supplies config.json and tokenizer files to copy; without it
# the model config and family stored in the checkpoint are used (--family llama|qwen2|qwen3 when
# the checkpoint has none). Runs as one process (it joins a gloo world of one); under torchrun it
# refuses WORLD_SIZE > 1. Environment: PYTHON (default python).
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: $0 CKPT OUT_DIR [--hf-config HF_DIR] [--family NAME] [--max-shard-size SIZE]" >&2
    exit 2
fi
CKPT=$1 OUT_DIR=$2
shift 2
exec "${PYTHON:-python}" -m megatron_earl.convert.cli mcore-to-hf --ckpt "$CKPT" --out "$OUT_DIR" "$@"
