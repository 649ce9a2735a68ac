"""Hugging Face <-> Megatron checkpoint conversion (Llama 2/3, Qwen2/2.5, Qwen3; Qwen3-MoE and
Mixtral).

    megatron-earl convert hf-to-mcore --hf HF_DIR --out MCORE_DIR [--tp 2 --pp 2]
    megatron-earl convert mcore-to-hf --ckpt MCORE_DIR --out HF_OUT [--hf-config HF_DIR]

``families`` maps HF configs to ``ModelConfig`` and back; ``mapping`` maps tensors (grouped QKV,
gated fc1, vocabulary padding); ``dcp`` streams a Megatron ``torch_dist`` checkpoint one layer at
a time; ``hf_io`` reads and writes sharded safetensors; ``convert`` runs both directions; ``cli``
is the command line; ``initial`` loads an HF directory or a Megatron checkpoint into a model being
trained; ``tiny`` builds tiny random HF models. The converter's peak memory is measured by
``megatron_earl.bench.convert_memory``. See megatron_earl/docs/conversion.md.
"""
