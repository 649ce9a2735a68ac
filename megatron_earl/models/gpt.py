"""Build a Llama/Qwen-family ``megatron.core`` GPTModel from a ``ModelConfig``.

The layer spec is Megatron's own (TE spec when Transformer Engine is importable, local spec
otherwise); on the local spec the core attention submodule is swapped for ``SDPAttention`` (or its
context-parallel variant when cp > 1). Nothing in the layers is forked.

Call after ``megatron.core.parallel_state`` describes the layout (``megatron_earl.parallel``).
"""

from __future__ import annotations

import copy

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_earl import runtime
from megatron_earl.compat.optional import has_transformer_engine
from megatron_earl.config.model import ModelConfig, ModelConfigError, build_transformer_config
from megatron_earl.patches import cpu_redirect


def resolve_attention_backend(model: ModelConfig) -> str:
    """The attention backend actually used: "te", "sdpa" or "local"."""
    if model.attention_backend == "auto":
        return "te" if has_transformer_engine() else "sdpa"
    if model.attention_backend == "te" and not has_transformer_engine():
        raise ModelConfigError(
            "attention_backend='te' but transformer_engine is not importable; "
            "install megatron-earl[te] or use attention_backend='sdpa'"
        )
    return model.attention_backend


def layer_spec(model: ModelConfig, cp: int = 1) -> ModuleSpec:
    """Megatron's transformer-layer spec for this model, with the project's core attention."""
    backend = resolve_attention_backend(model)
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(
        get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=model.qk_layernorm)
    )
    if backend == "local":
        if cp > 1:
            raise ModelConfigError("attention_backend='local' does not support cp > 1; use 'sdpa'")
        return spec
    if cp > 1:
        from megatron_earl.models.cp_attention import ContextParallelSDPAttention as core
    else:
        from megatron_earl.models.attention import SDPAttention as core
    spec.submodules.self_attention.submodules.core_attention = core
    return spec


def build_model(model: ModelConfig, *, vpp: int | None = None) -> list[GPTModel]:
    """Build this rank's model chunks (one per virtual pipeline stage) in the current layout.

    Every rank of the world must call this after the parallel state is initialised; parameters are
    initialised from Megatron's RNG tracker, so call ``megatron_earl.runtime.seed`` first for
    reproducible weights.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    device_policy = runtime.policy()
    # Weights are initialised where they live: on the CPU with Megatron's host initialisation;
    # on a device in place, as on CUDA (under the emulation tier Megatron's CUDA requests are
    # redirected to the emulated device, so it runs the same code path as on GPUs).
    config = build_transformer_config(
        model,
        tp=tp,
        pp=pp,
        cp=cp,
        vpp=vpp,
        use_cpu_initialization=device_policy.device.type == "cpu",
        batch_p2p_comm=device_policy.device_backend == "nccl",
    )
    spec = layer_spec(model, cp=cp)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(
            _build_chunk(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=model.padded_vocab_size,
                max_sequence_length=model.max_position_embeddings,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=stage
                ),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=stage
                ),
                share_embeddings_and_output_weights=model.tie_embeddings,
                position_embedding_type="rope",
                rotary_base=int(model.rotary_base),
                parallel_output=True,
                vp_stage=stage,
            )
        )
    return chunks


def _build_chunk(**kwargs) -> GPTModel:
    with cpu_redirect.when_applied():  # no-op on GPUs; CUDA -> compute device elsewhere
        return runtime.module_to_device(GPTModel(**kwargs))
