"""Build a Llama/Qwen-family ``megatron.core`` GPTModel from a ``ModelConfig``.

The layer spec is Megatron's own, chosen by ``model.transformer_impl``
(``models.impl.resolve_transformer_impl``): the Transformer Engine spec (TE attention; TE's context
parallelism, ``model.cp_comm_type``, when cp > 1) when TE is importable on CUDA, else the local
spec, whose core attention submodule is swapped for ``SDPAttention`` (or its context-parallel
variant when cp > 1). Nothing in the layers is forked.

A mixture-of-experts model (``model.num_experts``) gets megatron-core's ``MoELayer`` as the MLP of
every layer, from the same spec functions: ``TopKRouter``, a token dispatcher
(``MoEAlltoAllTokenDispatcher`` or ``MoEAllGatherTokenDispatcher``), ``SharedExpertMLP`` when
configured, and the experts as ``TEGroupedMLP`` (TE's grouped GEMM, ``model.moe_grouped_gemm``)
or ``SequentialMLP`` (one GEMM per expert: TE linears without grouped GEMM; ``ColumnParallelLinear``
/ ``RowParallelLinear`` on the local spec, which is what runs on a CPU). docs/moe.md.

Call after ``megatron.core.parallel_state`` describes the layout (``megatron_earl.parallel``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel as MegatronGPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from megatron_earl import runtime
from megatron_earl.config.model import ModelConfig, ModelConfigError, build_transformer_config
from megatron_earl.config.vocab import TransformerImpl
from megatron_earl.models.attention import SDPAttention
from megatron_earl.models.impl import (
    machine_facts,
    resolve_transformer_impl,
    transformer_impl_problems,
)
from megatron_earl.models.norms import HeadRMSNorm, HiddenRMSNorm
from megatron_earl.models.packed_attention import HostPackedSeqParams
from megatron_earl.models.tree_attention import is_tree
from megatron_earl.parallel.ddp import unwrap_chunk
from megatron_earl.patches import cpu_redirect, rope_tables


class GPTModel(MegatronGPTModel):
    """Megatron-Core's GPTModel, with RoPE at per-token positions for packed micro-batches.

    A tree row (``training.prefix_tree``) is one ``thd`` sequence whose tokens sit at positions
    of their own samples (a branch continues its prefix). ``_preprocess`` builds Megatron's
    rotary table as usual and, for a tree row (``tree_attention.is_tree``), hands the attention
    one row per token, indexed by its ``token_positions``; Megatron's thd RoPE maps a table of
    one row per packed token to the tokens one to one (``rope_utils._apply_rotary_pos_emb_thd``,
    "exact mapping", megatron-core 0.16). A packed micro-batch of whole samples
    (``packed_attention.HostPackedSeqParams``) gets the same: the table indexed by its tokens'
    ``position_ids`` (their positions in their samples, CP-split with the tokens), which
    ``patches/rope_tables.py`` applies as Megatron's per-sequence mapping would, at any cp,
    without reading ``cu_seqlens`` back from the device in every layer. Every other input runs
    Megatron's code unchanged."""

    def _preprocess(self, *args, **kwargs):
        out = super()._preprocess(*args, **kwargs)
        params = kwargs.get("packed_seq_params")
        if out[1] is None:
            return out
        if is_tree(params):
            return (out[0], out[1][params.token_positions], *out[2:])
        if isinstance(params, HostPackedSeqParams) and rope_tables.computes_per_token(self.config):
            # position_ids: the positions of this rank's tokens in their samples
            table = out[1][kwargs["position_ids"].reshape(-1)]
            return (out[0], rope_tables.per_token_table(table), *out[2:])
        return out


def tree_ready(chunks: Sequence[nn.Module]) -> bool:
    """Whether built model ``chunks`` run prefix-tree micro-batches: this module's GPTModel with
    the local spec's SDPAttention at cp = 1 in every layer (not TE's attention, not the CP
    variant, which read only ``cu_seqlens``)."""
    models = [unwrap_chunk(c) for c in chunks]
    cores = [m for g in models for m in g.modules() if hasattr(m, "core_attention")]
    return all(isinstance(g, GPTModel) for g in models) and all(
        type(m.core_attention) is SDPAttention for m in cores
    )


def layer_spec(model: ModelConfig, cp: int = 1) -> ModuleSpec:
    """Megatron's transformer-layer spec for this model: the TE spec (TE attention, with TE's
    context parallelism when cp > 1) or the local spec with the project's core attention; the MLP
    is megatron-core's ``MoELayer`` for an MoE model (experts: module docstring)."""
    facts = machine_facts()
    problems = transformer_impl_problems(model, embedded_engine=False, **facts)
    if problems:
        raise ModelConfigError("; ".join(problems))
    impl = resolve_transformer_impl(model.transformer_impl, **facts)
    if impl == TransformerImpl.TRANSFORMER_ENGINE:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        moe = (
            {"num_experts": model.num_experts, "moe_grouped_gemm": model.moe_grouped_gemm}
            if model.num_experts
            else {}
        )
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm, **moe)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # Experts: SequentialMLP (grouped GEMM needs Transformer Engine's kernels on CUDA).
    spec = copy.deepcopy(
        get_gpt_layer_local_spec(
            num_experts=model.num_experts or None,
            moe_grouped_gemm=False,
            normalization="RMSNorm",
            qk_layernorm=model.qk_layernorm,
        )
    )
    # Megatron's WrappedTorchNorm refuses sequence parallelism: the same torch.nn.RMSNorm, marked
    # for it (models/norms.py). The final layernorm is set per chunk (block_spec).
    spec.submodules.input_layernorm = HiddenRMSNorm
    spec.submodules.pre_mlp_layernorm = HiddenRMSNorm
    if model.qk_layernorm:
        spec.submodules.self_attention.submodules.q_layernorm = HeadRMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = HeadRMSNorm
    if model.attention_backend == "local":
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
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    device_policy = runtime.policy()
    impl = resolve_transformer_impl(model.transformer_impl, **machine_facts())
    # Weights are initialised where they live: on the CPU with Megatron's host initialisation;
    # on a device in place, as on CUDA (under the emulation tier Megatron's CUDA requests are
    # redirected to the emulated device, so it runs the same code path as on GPUs).
    config = build_transformer_config(
        model,
        tp=tp,
        pp=pp,
        cp=cp,
        vpp=vpp,
        ep=ep,
        etp=etp,
        use_cpu_initialization=device_policy.device.type == "cpu",
        batch_p2p_comm=device_policy.device_backend == "nccl",
        grouped_gemm=model.moe_grouped_gemm and impl == TransformerImpl.TRANSFORMER_ENGINE,
    )
    spec = layer_spec(model, cp=cp)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(
            _build_chunk(
                model,
                config=config,
                transformer_layer_spec=block_spec(spec, config, stage),
                vocab_size=model.padded_vocab_size,
                max_sequence_length=model.max_position_embeddings,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=stage
                ),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=stage
                ),
                share_embeddings_and_output_weights=model.tie_embeddings,
                **rope_kwargs(model),
                parallel_output=True,
                vp_stage=stage,
            )
        )
    return chunks


def block_spec(spec: ModuleSpec, config, vp_stage: int | None):
    """The decoder block of one chunk: ``spec``'s layers as Megatron counts them for this stage,
    and a final layernorm like the layers' (the local spec's ``HiddenRMSNorm``; Megatron's default
    otherwise). A TE layer spec is returned as is (TE's norms handle sequence parallelism)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if spec.submodules.input_layernorm is not HiddenRMSNorm:
        return spec
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=HiddenRMSNorm)


def rope_kwargs(model: ModelConfig) -> dict:
    """GPTModel's RoPE arguments for ``model.rope_type``: Megatron-Core's ``RotaryEmbedding``
    (``linear``: its ``seq_len_interpolation_factor``; ``llama3``: its ``rope_scaling``) or
    ``YarnRotaryEmbedding`` (``yarn``; its settings are TransformerConfig attributes, set by
    ``build_transformer_config``)."""
    kwargs = {"position_embedding_type": "rope", "rotary_base": int(model.rotary_base)}
    if model.rope_type == "linear":
        kwargs["seq_len_interpolation_factor"] = model.rope_scaling_factor
    elif model.rope_type == "llama3":
        kwargs |= {"rope_scaling": True, "rope_scaling_factor": model.rope_scaling_factor}
    elif model.rope_type == "yarn":
        kwargs |= {"position_embedding_type": "yarn", "rotary_base": model.rotary_base}
    return kwargs


def _llama3_inv_freq(gpt: GPTModel, model: ModelConfig) -> None:
    """Recompute a llama3 rotary module's frequencies with ``model``'s low/high frequency factors
    and original context: Megatron-Core's ``RotaryEmbedding.__init__`` calls its own
    ``_apply_scaling`` with the factor only (1, 4 and 8192 fixed, Llama 3.1's values), so it is
    called again here, on the unscaled frequencies, with all four (megatron-core 0.16)."""
    rotary = gpt.rotary_pos_emb
    dim = rotary.inv_freq.numel() * 2
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=rotary.inv_freq.device) / dim
    rotary.inv_freq = rotary._apply_scaling(
        1.0 / (int(model.rotary_base) ** exponent),
        factor=model.rope_scaling_factor,
        low_freq_factor=model.rope_low_freq_factor,
        high_freq_factor=model.rope_high_freq_factor,
        original_max_position_embeddings=model.rope_original_max_position_embeddings,
    )


def _build_chunk(model: ModelConfig, **kwargs) -> GPTModel:
    with cpu_redirect.when_applied():  # no-op on GPUs; CUDA -> compute device elsewhere
        gpt = GPTModel(**kwargs)
        if model.rope_type == "llama3":
            _llama3_inv_freq(gpt, model)
        return runtime.module_to_device(gpt)
