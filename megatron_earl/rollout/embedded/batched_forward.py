"""The embedded engine's forward: Megatron's own modules run on a ragged batch with a row cache.

    fwd = BatchedForward(gpt_model, max_batch_size=64, max_seq_len=1024)
    logits_kV = fwd(Batch(rows=(3, 4), tokens=((5, 9, 2), (7, 1)), starts=(0, 0)))  # prefill
    logits_nV = fwd(Batch.decode(lengths=[4, 3, 9], tokens=[11, 12, 13]))    # rows 0..2

Why not ``GPTModel.forward``: Megatron's static inference path (0.16) batches statically -- one
write offset for the whole batch, keys cached un-rotated and the whole cache re-rotated on every
step, GQA keys repeated per step -- and runs one request's prefill per call; its module stack
costs more Python per step than the arithmetic of a small model. Here every step is one forward
of *packed* tokens ``[T, h]`` (a decode step: one token per running request; a prefill step: the
whole contexts of the requests admitted together) over the model's own parameters, in the order
``TransformerLayer`` applies its submodules:

    embedding (the VocabParallelEmbedding's shard) -> per layer: input_layernorm, fused QKV
    projection (+ qkv bias, q/k layernorm), RoPE at each token's position, KV-cache write,
    attention, output projection + TP all-reduce + bias, residual, pre_mlp_layernorm, fc1,
    SwiGLU, fc2 + TP all-reduce + bias (or the layer's megatron-core ``MoELayer``, below),
    residual -> final_layernorm and output layer (+ TP all-gather of the vocabulary) on each
    sequence's last token only (a prefill's last layer runs
    its output projection and MLP on those tokens only, and its attention too when no prompt
    log-probs are asked: nothing reads the others).

The projections are ``F.linear`` on the Megatron modules' own parameters (the local shards of a
column-/row-parallel layer) with the reductions Megatron's tensor-parallel layers perform, the
norms are the modules' own ``torch.nn.RMSNorm`` weights and eps, the split of the fused QKV output
follows ``SelfAttention.get_query_key_value_tensors`` (groups of ``[q x rep, k, v]``), the SwiGLU
follows ``MLP``'s ``glu`` (``silu(first half) * second half`` of the local fc1 output) and RoPE
is the formula of Megatron's ``_apply_rotary_pos_emb_bshd`` with the cos/sin tables of the
model's own rotary module (computed once; YaRN's mscale applied as Megatron's attention does).
``check_supported`` rejects model features this order does not cover. The engine tests compare
greedy tokens with a no-cache ``GPTModel.forward`` decode and log-probs with the training
forward, at TP1 and TP2. Attention: SDPA, GQA without repeating keys (decode: the query heads of
a group attend as a group, and so do a prefill's last tokens in its last layer; prefill:
``enable_gqa``), a key-padding mask for rows of different
lengths. A decode step is one tensor-only function (``_decode``), optionally run compiled
(``compile_decode``); so is a prefill step (``_prefill``, ``compile_prefill``: its attention
then written out as matrix products, up to ``PREFILL_COMPILE_MAX_SCORES``). A step's sequences
(``Batch``) and a prefill's index tensors (``StepIndex``) come from ``rollout/embedded/step.py``.

Legend: T = tokens in the step, k = sequences in the step, n = running rows, L = cached length,
h = hidden, np/ng = query heads/groups on this TP rank, hn = head dim, V = padded vocabulary,
R = tokens whose logits a prefill returns, W = a prefill's cache writes, G = sequences (or rows)
x groups, r/rep = query heads per group, Q = rep x a prefill's widest new tokens.
A mixture-of-experts layer runs megatron-core's own ``MoELayer`` (router, token dispatcher,
experts, shared experts) on the step's tokens, eagerly; at tp > 1 each TP rank routes its slice
of them (sequence parallelism, which megatron-core requires for MoE there) and the outputs are
all-gathered (``_moe``). Its experts live in the engine's TP group (ep 1).

Which ranks call: every rank of the TP group runs every step (all-reduces and the vocabulary
all-gather on the TP group, and an MoE layer's dispatcher collectives and output all-gather;
nothing with tp = 1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config
from megatron.core.transformer.identity_op import IdentityOp
from torch import nn

from megatron_earl import runtime
from megatron_earl.config.embedded import kv_cache_rows
from megatron_earl.models.rotary import cos_signed_sin
from megatron_earl.models.routing import moe_routers, recording
from megatron_earl.parallel.ddp import unwrap_chunk
from megatron_earl.rollout.embedded.kv_cache import RowCache
from megatron_earl.rollout.embedded.step import Batch, StepIndex, StepTensors

MIB = 1 << 20

PREFILL_COMPILE_MAX_SCORES = 1 << 22
"""Largest attention score tensor (sequences x query heads x the longest new tokens x the
longest keys) of a prefill step that runs compiled (``compile_prefill``). The compiled step
writes its attention out as two batched matrix products around a softmax that inductor fuses,
which holds every score at once; a larger step (a long context) runs eagerly, where SDPA's
blockwise kernel never does."""

PREFILL_WARM_TOKENS = 8
"""New tokens per sequence of the prefill step that compiles the prefill graph
(``BatchedForward._compile_graphs``; fewer when ``max_seq_len // 2`` is smaller, at least 2)."""


def check_supported(gpt: nn.Module) -> None:
    """Raise ``ValueError`` naming the first model feature the batched forward does not cover."""
    config = gpt.config
    problems = {
        "pipeline stages (pre_process and post_process both needed)": not (
            gpt.pre_process and gpt.post_process
        ),
        f"position_embedding_type={gpt.position_embedding_type!r}": gpt.position_embedding_type
        not in ("rope", "yarn"),
        "rotary_interleaved": config.rotary_interleaved,
        "multi_latent_attention": config.multi_latent_attention,
        "apply_residual_connection_post_layernorm": (
            config.apply_residual_connection_post_layernorm
        ),
        "attention_output_gate": getattr(config, "attention_output_gate", False),
        f"expert_model_parallel_size={config.expert_model_parallel_size} > 1 (the engine's "
        "MoE layers run their experts in the engine's own TP group)": bool(config.num_moe_experts)
        and config.expert_model_parallel_size > 1,
        "context_parallel_size > 1": config.context_parallel_size > 1,
        "no_rope_freq": bool(getattr(config, "no_rope_freq", None)),
        "an MLP other than SwiGLU": not config.num_moe_experts
        and not (
            config.gated_linear_unit
            and config.activation_func is F.silu
            and config.activation_func_clamp_value is None
            and config.glu_linear_offset == 0.0
        ),
        f"num_query_groups={config.num_query_groups} < tp={config.tensor_model_parallel_size}": (
            (config.num_query_groups or config.num_attention_heads)
            < config.tensor_model_parallel_size
        ),
        "norms other than torch.nn.RMSNorm": any(
            not isinstance(norm, nn.RMSNorm) and norm is not None
            for layer in gpt.decoder.layers
            for norm in (
                layer.input_layernorm,
                layer.pre_mlp_layernorm,
                _norm_or_none(layer.self_attention.q_layernorm),
                _norm_or_none(layer.self_attention.k_layernorm),
            )
        )
        or not isinstance(gpt.decoder.final_layernorm, nn.RMSNorm),
    }
    bad = [name for name, hit in problems.items() if hit]
    if bad:
        raise ValueError(f"the embedded engine's batched forward does not support {bad[0]}")


def _norm_or_none(module: nn.Module | None) -> nn.Module | None:
    """A q/k layernorm, or None where Megatron put none (``IdentityOp`` or None)."""
    return None if module is None or isinstance(module, IdentityOp) else module


def _rms(norm: nn.RMSNorm | None):
    """The norm as a plain function of x (its own weight and eps), or None."""
    if norm is None:
        return None
    return lambda x: F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


@dataclass(frozen=True)
class _Layer:
    """One transformer layer's parameters (Megatron's own tensors, this rank's shards)."""

    norm1: object
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: object
    k_norm: object
    proj_weight: torch.Tensor
    proj_bias: torch.Tensor | None
    norm2: object
    fc1_weight: torch.Tensor | None
    fc1_bias: torch.Tensor | None
    fc2_weight: torch.Tensor | None
    fc2_bias: torch.Tensor | None
    moe: nn.Module | None = None
    """The layer's megatron-core ``MoELayer`` (router, token dispatcher, experts), run as it is;
    None for a dense layer (the SwiGLU of ``fc1``/``fc2``)."""

    @classmethod
    def of(cls, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attention, layer.mlp
        moe = mlp if hasattr(mlp, "router") else None
        dense = (None,) * 4
        if moe is None:
            fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
            dense = (fc1.weight, fc1.bias, fc2.weight, fc2.bias)
        return cls(
            _rms(layer.input_layernorm),
            attn.linear_qkv.weight,
            attn.linear_qkv.bias,
            _rms(_norm_or_none(attn.q_layernorm)),
            _rms(_norm_or_none(attn.k_layernorm)),
            attn.linear_proj.weight,
            attn.linear_proj.bias,
            _rms(layer.pre_mlp_layernorm),
            *dense,
            moe=moe,
        )


class BatchedForward:
    """Runs steps (``Batch``) through one GPT model chunk and its row cache (module docstring).

    The layer parameters are referenced, not copied: weights written into the chunk in place
    (a reshard, ``load_full_state_dict``) are what the next step computes with.

    The row cache holds ``max_batch_size`` rows of ``max_seq_len`` tokens, or fewer when
    ``kv_cache_bytes`` (the cache's memory budget on this rank) holds fewer whole rows
    (``config.embedded.kv_cache_rows``); a budget that holds no row is refused.

    ``compile_decode``: decode steps run ``torch.compile`` of ``_decode`` (inductor: fused C++
    kernels for the norms, RoPE, cache writes, the attention (``_attend_decode_fused``) and
    SwiGLU; the projections stay library calls),
    one graph with the row count and key length dynamic plus one for a single row (sizes 0
    and 1 are specialised). ``compile_prefill``: prefill steps up to
    ``PREFILL_COMPILE_MAX_SCORES`` run ``torch.compile`` of ``_prefill`` (the same fusions, the
    attention as ``_attend_prefill_fused``), one graph for several sequences and one for a
    single sequence, each returning its last token's logits; other shapes
    (``_fits_compiled_prefill``: one-token continuations, prompt log-probs)
    and larger prefills run eagerly. Every graph is compiled at the first step
    of any kind, while the cache holds nothing yet (tens of seconds on a CPU, seconds from
    inductor's cache). TP 1 only (the graphs hold no collectives)."""

    def __init__(
        self,
        model: nn.Module,
        max_batch_size: int,
        max_seq_len: int,
        compile_decode: bool = False,
        compile_prefill: bool = False,
        kv_cache_bytes: float | None = None,
        record_routes: bool = False,
    ) -> None:
        gpt = unwrap_chunk(model)
        check_supported(gpt)
        self.gpt = gpt
        self.layers = [_Layer.of(layer) for layer in gpt.decoder.layers]
        attn = gpt.decoder.layers[0].self_attention
        self.num_groups = attn.num_query_groups_per_partition
        self.num_heads = attn.num_attention_heads_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        self.scale = attn.core_attention.softmax_scale
        self.final_norm = _rms(gpt.decoder.final_layernorm)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        weight = attn.linear_qkv.weight
        self.device = weight.device
        self.max_seq_len = max_seq_len
        compiled = compile_decode or compile_prefill
        # Compiled: one spare key position, so that no step's key length is the cache's whole
        # length (a slice of the whole dimension would specialise the dynamic graph to it).
        length = max_seq_len + 1 if compiled else max_seq_len
        self.routers = moe_routers([gpt]) if record_routes else []
        if record_routes and not self.routers:
            raise ValueError(
                "record_routes (routing replay) needs a mixture-of-experts model; this one has "
                "no MoE layer"
            )
        routes = (len(self.routers), self.routers[0].topk) if self.routers else None
        row = RowCache.row_bytes(
            len(self.layers), self.num_groups, self.head_dim, length, weight.dtype, routes
        )
        rows = kv_cache_rows(max_batch_size, row, kv_cache_bytes)
        if rows < 1:
            raise ValueError(
                f"the KV-cache budget ({kv_cache_bytes / MIB:.4g} MiB on this rank) holds no row "
                f"of max_seq_len={max_seq_len} tokens ({row / MIB:.4g} MiB a row: "
                f"{len(self.layers)} layers x K/V x {self.num_groups} groups x {length} positions "
                f"x head dim {self.head_dim} x {weight.element_size()} B); give it at least "
                f"{row / MIB:.4g} MiB, a shorter context, or more tp (fewer groups per rank)"
            )
        self.cache = RowCache(
            len(self.layers),
            self.num_groups,
            self.head_dim,
            rows,
            length,
            dtype=weight.dtype,
            device=weight.device,
            routes=routes,
        )
        self.cos, self.sin = self._rope_tables(max_seq_len, weight.dtype)
        moe = any(layer.moe is not None for layer in self.layers)
        for name, on in (("compile_decode", compile_decode), ("compile_prefill", compile_prefill)):
            if on and self.tp > 1:
                raise ValueError(
                    f"{name} needs tp = 1 (the compiled step holds no TP collectives), got "
                    f"tp={self.tp}; leave it off for a TP engine"
                )
            if on and moe:
                raise ValueError(
                    f"{name} needs a dense model (the MoE layers' token dispatch sizes its "
                    "buffers from the routing, which a graph cannot hold); set "
                    f"rollout.embedded.{name}: false for a mixture-of-experts model"
                )
        self._decode_compiled = torch.compile(self._decode) if compile_decode else None
        self._prefill_compiled = torch.compile(self._prefill) if compile_prefill else None
        self._compiled_ready = not compiled
        """Whether every compiled graph exists (``_compile_graphs``)."""

    @torch.no_grad()
    def _rope_tables(self, max_seq_len: int, dtype: torch.dtype):
        """cos and signed sin ``[max_seq_len, 1, 1, rot]`` of the model's rotary module, scaled by
        mscale as Megatron's attention does, on the compute device (``_rope``)."""
        emb = self.gpt.rotary_pos_emb(max_seq_len)
        freqs = (emb[0] if isinstance(emb, tuple) else emb)[:, 0].to(self.device)
        mscale = _yarn_get_concentration_factor_from_config(self.gpt.config)
        cos, signed = cos_signed_sin(freqs, mscale, dtype)
        return cos[:, None], signed[:, None]

    def _compiled_decode(self, ids_n, pos_n, key_pos_L) -> torch.Tensor:
        for t in (ids_n, pos_n, key_pos_L):  # one graph for every row count and length
            torch._dynamo.mark_dynamic(t, 0)
        return self._decode_compiled(ids_n, pos_n, key_pos_L)

    def _compiled_prefill(self, step: StepTensors, warm_up: bool = False) -> torch.Tensor:
        """Run a prefill step through the compiled graph (every index size dynamic).
        ``warm_up``: the step that compiles it (``_compile_graphs``), whose sizes are passed as
        explicit size hints: inductor's on-disk cache keys on those, not on plain hints, so a
        graph cached by a build that compiled on other sizes is not reused with that build's
        kernels (and an engine of another ``max_batch_size`` compiles its own)."""
        for t in step:  # one graph for every token, sequence and key count
            torch._dynamo.mark_dynamic(t, 0, hint_override=t.size(0) if warm_up else None)
        return self._prefill_compiled(step, fresh=False, shared=True, last_only=True)

    def _compile_graphs(self) -> None:
        """Compile every graph before the first real step, while no row caches anything: the
        decode step for several rows (the dynamic graph) and for one row, the prefill step for
        several sequences and for one (sizes 0/1 are specialised), so a step that first runs a
        single row or sequence later -- the end of a batch, a multi-turn session alone on its
        engine -- does not pay a compilation mid-rollout.

        Inductor decides each fused kernel's threading from the sizes it compiles for: it runs
        a loop on several threads only when those sizes give each thread enough work. So the
        prefill graph compiles on a step of the engine's scale -- every row, each with
        ``PREFILL_WARM_TOKENS`` new tokens: compiled on two sequences of two tokens, its norm,
        RoPE and SwiGLU kernels ran on one thread at any size; at most as many rows as keep the
        warm-up within ``PREFILL_COMPILE_MAX_SCORES``. The decode graph compiles on two rows: a
        decode step's per-row kernels are small enough that threads cost more than they save
        (both measured: docs/measurements/engine.md). The warm-up steps write keys and
        values only where any real sequence writes its own before attending to them (a step
        writes a position before it reads it): the decode step at the last position, the
        prefill at ``[start, start + warm)`` (``[8, 16)`` when ``max_seq_len >= 16``), so that
        its attention stays small whatever ``max_seq_len`` is."""
        last = self.max_seq_len - 1
        rows = self.cache.max_batch_size
        counts = (2, 1) if rows >= 2 else (1,)
        for n in counts if self._decode_compiled is not None else ():
            ids, pos, key_pos = (
                runtime.to_device(t)
                for t in (
                    torch.zeros(n, dtype=torch.long),
                    torch.full((n,), last, dtype=torch.long),
                    torch.arange(last + 1),
                )
            )
            self._compiled_decode(ids, pos, key_pos)
        prefills = self._prefill_compiled is not None and self.max_seq_len >= 2
        warm = max(2, min(PREFILL_WARM_TOKENS, self.max_seq_len // 2))
        start = min(warm, self.max_seq_len - warm)
        fits = PREFILL_COMPILE_MAX_SCORES // (self.num_heads * warm * (start + warm))
        several = max(2, min(rows, fits))
        prefill_counts = (several, 1) if rows >= 2 else (1,)
        for n in prefill_counts if prefills else ():
            batch = Batch(tuple(range(n)), ((0,) * warm,) * n, (start,) * n)
            self._compiled_prefill(StepIndex.build(batch).on_device(), warm_up=True)
        self._compiled_ready = True

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.cache.move_row(src, dst, length)

    def _embed(self, ids_T: torch.Tensor) -> torch.Tensor:
        """The input embeddings ``[T, h]``: this rank's vocabulary shard looked up, other ranks'
        ids zeroed, summed over TP (``VocabParallelEmbedding``'s forward without its reduce-scatter
        under sequence parallelism: here every TP rank keeps every token)."""
        table = self.gpt.embedding.word_embeddings
        if self.tp == 1:
            return F.embedding(ids_T, table.weight)
        outside = (ids_T < table.vocab_start_index) | (ids_T >= table.vocab_end_index)
        local = (ids_T - table.vocab_start_index).masked_fill_(outside, 0)
        return self._reduce(F.embedding(local, table.weight).masked_fill_(outside[:, None], 0.0))

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's partial sums summed over TP (every TP rank calls)."""
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    @torch.inference_mode()
    def __call__(self, batch: Batch) -> torch.Tensor:
        """Full-vocabulary logits ``[k, V]`` (fp32) at the last new token of each sequence (with
        ``batch.logits_from``: at its new tokens from that index on, sequence after sequence);
        the new tokens' keys and values are written to the cache (and, with ``record_routes``,
        their routed experts: ``cache.routes``). Every rank of the TP group calls (the forward's
        TP collectives; with ``record_routes`` one all-gather of the routes more)."""
        if not self._compiled_ready:
            self._compile_graphs()
        with recording(self.routers) if self.routers else contextlib.nullcontext() as routes:
            if batch.is_decode:
                ids_n, pos_n, key_pos_L = (
                    runtime.to_device(t)
                    for t in (
                        torch.tensor([t[0] for t in batch.tokens], dtype=torch.long),
                        torch.tensor(batch.starts, dtype=torch.long),
                        torch.arange(max(batch.starts) + 1),
                    )
                )
                if self._decode_compiled is None:
                    logits = self._decode(ids_n, pos_n, key_pos_L)
                else:
                    logits = self._compiled_decode(ids_n, pos_n, key_pos_L)
                if routes is not None:
                    n = ids_n.size(0)
                    rows = torch.arange(n, device=pos_n.device)
                    # each TP rank routed its slice of the tokens (``_moe``), padding last
                    self.cache.write_routes(rows, pos_n, self._tp_gather(routes())[:n])
                return logits
            index = StepIndex.build(batch)
            step = index.on_device()
            if self._prefill_compiled is not None and self._fits_compiled_prefill(index):
                return self._compiled_prefill(step)
            # recording routes: the last layer's MLP runs on every token (its router sees them)
            last_only = index.num_returned == index.num_seqs and not self.routers
            logits = self._prefill(step, index.fresh, index.shared, last_only)
            if routes is not None:
                routes_TLk = self._tp_gather(routes())  # slices of ``_moe``, padding last
                self.cache.write_routes(step.w_rows, step.w_pos, routes_TLk[step.w_src])
            return logits

    def _tp_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``x`` of every TP rank concatenated along ``dim``, ``x`` itself at tp 1. Every rank of
        the TP group calls (one all-gather)."""
        if self.tp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def _fits_compiled_prefill(self, index: StepIndex) -> bool:
        """Whether a prefill step runs compiled: at most ``PREFILL_COMPILE_MAX_SCORES`` scores,
        and the shape of a graph compiled at the first step -- several sequences (every size
        dynamic from 2) or one, each returning its last token's logits -- with at least 2 new
        tokens in some sequence (a size of 0 or 1 is specialised: any other shape would compile
        a graph mid-rollout). The rest -- one-token continuations, prompt log-probs, long
        contexts -- run eagerly."""
        k = index.num_seqs
        scores = k * self.num_heads * index.max_new * index.max_key_len
        warmed = index.max_new >= 2 and index.num_returned == k
        return warmed and scores <= PREFILL_COMPILE_MAX_SCORES

    def _prefill(
        self, step: StepTensors, fresh: bool, shared: bool, last_only: bool
    ) -> torch.Tensor:
        """A prefill step (``StepTensors``): logits ``[R, V]`` of the returned tokens. Only
        tensors and three flags in, so that one compiled graph serves every such step:
        compiled, the attention is ``_attend_prefill_fused`` (and the caller passes
        ``shared=True``, ``fresh=False``, ``last_only=True``); eagerly, SDPA (``_attend_ragged``),
        causal alone when ``fresh`` (no sequence has a cached prefix), and the keys/values are
        gathered per write only when ``shared`` (some sequence's go to further rows).

        Past the last layer's cache write only the returned tokens matter: its output projection
        and MLP run on those alone, and when each sequence returns its last token only
        (``last_only``: no prompt log-probs) so does its attention -- one query per sequence and
        group over the sequence's keys, as a decode step attends."""
        compiling = torch.compiler.is_compiling()
        cos, sin = self.cos[step.pos], self.sin[step.pos]  # [T, 1, 1, rot]: for every layer
        blocked = _prefill_blocked(step) if compiling or not fresh else None  # for every layer
        x = self._embed(step.ids)  # [T, h]
        final = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            if shared:
                k, v = k[step.w_src], v[step.w_src]
            self.cache.write(i, step.w_rows, step.w_pos, k, v)
            keys, values = self.cache.gather(i, step.rows, step.key_pos.size(0))
            if i == final and last_only:
                ctx = self._attend_last(q[step.last], keys, values, step)
            elif compiling:
                ctx = _attend_prefill_fused(q, keys, values, blocked, step, self.scale)
            else:
                ctx = self._attend_ragged(q, keys, values, step, blocked)
            if i == final and not self.routers:  # [R, h] from here on
                x = x[step.last]
                ctx = ctx if last_only else ctx[step.last]
            x = self._mlp(layer, self._attn_out(layer, x, ctx))
        if self.routers:  # every token went through the last layer (its routes are recorded)
            x = x[step.last]
        return self._logits(self.final_norm(x))

    def _attend_last(self, q_kgrh, keys, values, step: StepTensors) -> torch.Tensor:
        """One query per sequence (its last new token) and group over the sequence's keys
        ``[k, ng, L, hn]``, keys past the query masked: the decode step's attention
        (``_attend_decode``, fused when compiled). -> ``[k, np * hn]``."""
        k_seqs, ng, _, hn = keys.shape
        bias = _key_bias(step.pos[step.last], step.key_pos, ng, self.cos.dtype)
        attend = _attend_decode_fused if torch.compiler.is_compiling() else _attend_decode
        return attend(q_kgrh.reshape(k_seqs * ng, -1, hn), keys, values, bias, self.scale)

    def _decode(self, ids_n: torch.Tensor, pos_n: torch.Tensor, key_pos_L: torch.Tensor):
        """A decode step: row r's one new token ``ids_n[r]`` at position ``pos_n[r]``, rows
        ``0 .. n-1``, key positions ``key_pos_L = arange(L)`` (L: the longest row's keys);
        logits ``[n, V]``. Only tensors in, so that one compiled graph serves every step."""
        n, ng, hn, length = ids_n.size(0), self.num_groups, self.head_dim, key_pos_L.size(0)
        rep = self.num_heads // ng
        cos, sin = self.cos[pos_n], self.sin[pos_n]  # [n, 1, 1, rot]: shared by every layer
        bias = _key_bias(pos_n, key_pos_L, ng, self.cos.dtype)  # for every layer
        rows = torch.arange(n, device=pos_n.device)
        attend = _attend_decode_fused if torch.compiler.is_compiling() else _attend_decode
        x = self._embed(ids_n)  # [n, h]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self.cache.write(i, rows, pos_n, k, v)
            keys, values = self.cache.view(i, 0, n, length)
            ctx = attend(q.reshape(n * ng, rep, hn), keys, values, bias, self.scale)
            x = self._mlp(layer, self._attn_out(layer, x, ctx))
        return self._logits(self.final_norm(x))

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries ``[T, ng, rep, hn]``, keys and values ``[T, ng, hn]`` (keys and queries
        rotated) of the fused QKV projection."""
        ng, hn = self.num_groups, self.head_dim
        rep = self.num_heads // ng
        qkv = F.linear(layer.norm1(x), layer.qkv_weight, layer.qkv_bias)
        qkv = qkv.view(-1, ng, rep + 2, hn)  # groups of [q x rep, k, v]
        if layer.q_norm is None:  # one rotation for the queries and the key of each group
            qk = _rope(qkv[:, :, : rep + 1], cos, sin)
            q, k = qk[:, :, :rep], qk[:, :, rep]
        else:
            q = _rope(layer.q_norm(qkv[:, :, :rep]), cos, sin)
            k = _rope(layer.k_norm(qkv[:, :, rep : rep + 1]), cos, sin)[:, :, 0]
        return q, k, qkv[:, :, rep + 1]

    def _attn_out(self, layer: _Layer, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention's output projection."""
        return x + _bias(self._reduce(F.linear(ctx, layer.proj_weight)), layer.proj_bias)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer's SwiGLU MLP (or its MoE layer)."""
        if layer.moe is not None:
            return x + self._moe(layer.moe, layer.norm2(x))
        gate, up = torch.chunk(
            F.linear(layer.norm2(x), layer.fc1_weight, layer.fc1_bias), 2, dim=-1
        )
        return x + _bias(
            self._reduce(F.linear(F.silu(gate) * up, layer.fc2_weight)), layer.fc2_bias
        )

    def _moe(self, moe: nn.Module, h_Th: torch.Tensor) -> torch.Tensor:
        """megatron-core's ``MoELayer`` on the step's tokens ``[T, h]`` (the same on every TP
        rank). At tp > 1 the layer expects its input split over TP along the tokens (sequence
        parallelism, which megatron-core requires for MoE there): each rank takes its slice of
        the tokens padded to a multiple of tp, and the outputs are all-gathered over TP."""
        tokens = h_Th.size(0)
        if self.tp > 1:
            per = -(-tokens // self.tp)
            padded = F.pad(h_Th, (0, 0, 0, per * self.tp - tokens))
            rank = dist.get_rank(self.tp_group)
            h_Th = padded[rank * per : (rank + 1) * per]
        out, bias = moe(h_Th[:, None, :])
        out = _bias(out[:, 0], bias)
        return self._tp_gather(out)[:tokens]

    def _logits(self, hidden_kh: torch.Tensor) -> torch.Tensor:
        """Output layer on the last tokens; the vocabulary shards all-gathered over TP."""
        gpt = self.gpt
        if gpt.share_embeddings_and_output_weights:
            weight = gpt.shared_embedding_or_output_weight()
        else:
            weight = gpt.output_layer.weight
        logits = F.linear(hidden_kh, weight, gpt.output_layer.bias)
        return self._tp_gather(logits, dim=-1).float()

    def _attend_ragged(self, q_Tgrh, keys, values, step: StepTensors, blocked):
        """Sequences of several new tokens, padded to the longest (the queries gathered by
        ``step.slot``): causal over each sequence's cached prefix and new tokens, padding keys
        masked -- by ``blocked`` (``_prefill_blocked``), or, when it is None (no sequence has a
        cached prefix), by SDPA's causal mask alone."""
        k_seqs, width = keys.size(0), step.width.size(0)
        q = q_Tgrh[step.slot].view(k_seqs, width, self.num_heads, self.head_dim).transpose(1, 2)
        if blocked is None:  # no cached prefix: right padding never reaches a real query
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=~blocked[:, None], scale=self.scale, enable_gqa=True
            )
        return out.transpose(1, 2)[step.seq, step.local].reshape(len(step.seq), -1)


def _key_bias(pos_n, key_pos_L, ng: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive key-padding bias ``[n * ng, 1, L]`` of one query per row and group at
    ``pos_n``, keys at ``key_pos_L = arange(L)``: 0 at or before the query, -inf after."""
    length = key_pos_L.size(0)
    blocked = key_pos_L[None, :] > pos_n[:, None]
    bias = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device)
    bias = bias.masked_fill_(blocked, float("-inf"))[:, None, None, :]
    return bias.expand(-1, ng, 1, length).reshape(-1, 1, length)


def _attend_decode(q_Grh, keys, values, bias_G1L, scale: float) -> torch.Tensor:
    """One new query per row; the ``rep`` query heads of a group attend together to the group's
    cached keys (G = rows x groups; keys/values ``[n, ng, L, hn]``: views of the cache in a
    decode step, merged to ``[G, L, hn]`` without a copy, or the rows a prefill gathered for its
    last layer): scores in the model's dtype, softmax in fp32, weighted values ->
    ``[n, np*hn]``.
    Three batched matmul-sized ops; SDPA with a mask costs twice as much at decode sizes."""
    n, ng, length, hn = keys.shape
    k_GLh, v_GLh = keys.reshape(n * ng, length, hn), values.reshape(n * ng, length, hn)
    scores = torch.baddbmm(bias_G1L, q_Grh, k_GLh.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v_GLh.dtype)
    return torch.bmm(probs, v_GLh).reshape(n, -1)


def _attend_decode_fused(q_Grh, keys, values, bias_G1L, scale: float) -> torch.Tensor:
    """``_attend_decode`` for the compiled step: the scores and the weighted values as
    broadcast products summed over the head dimension / the keys, which inductor turns into
    its own fused loops. Each of the ``n * ng`` matrix products is a few thousand
    multiply-adds; as batched GEMM library calls (``_attend_decode``) they took longer inside
    the compiled step up to a few hundred keys (docs/measurements/engine.md: measured to
    4,096 keys both ways)."""
    n, ng, length, hn = keys.shape
    k_G1Lh = keys.reshape(n * ng, 1, length, hn)
    v_G1Lh = values.reshape(n * ng, 1, length, hn)
    scores = (q_Grh[:, :, None, :] * k_G1Lh).sum(-1) * scale + bias_G1L
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v_G1Lh.dtype)
    return (probs[..., None] * v_G1Lh).sum(2).reshape(n, -1)


def _prefill_blocked(step: StepTensors) -> torch.Tensor:
    """Which keys each (padded) query of a prefill step may not see -- those after its own
    position -- as ``[k, width, L]`` booleans for ``_attend_prefill_fused``; built once for every
    layer."""
    q_pos = step.start[:, None] + step.width[None, :]  # [k, width]
    return step.key_pos[None, None, :] > q_pos[:, :, None]


def _attend_prefill_fused(q_Tgrh, keys, values, blocked, step: StepTensors, scale: float):
    """A prefill's attention in the compiled step: the queries gathered into a padded
    ``[k, width, ng, rep, hn]`` (``step.slot``), then per (sequence, group) ``softmax(q k^T *
    scale, keys masked by blocked) v`` as two batched matrix products -- each a few hundred
    thousand multiply-adds at the sizes that compile (``PREFILL_COMPILE_MAX_SCORES``), where
    SDPA's blockwise kernel costs more than the arithmetic. Inductor fuses the gather into the
    layout copy the product reads, and the scale and the mask into the softmax, which reads the
    ``[k, width, L]`` mask instead of a materialised ``[k * ng, rep * width, L]`` bias. Padded
    queries (copies of their sequence's last token) see key 0 at least (no row is all -inf) and
    are dropped. Scores and softmax in fp32 (as SDPA accumulates), whatever the model's dtype.
    -> ``[T, np * hn]``."""
    k_seqs, ng, length, hn = keys.shape
    rep, width = q_Tgrh.size(2), step.width.size(0)
    q = q_Tgrh[step.slot].view(k_seqs, width, ng, rep, hn)
    q_GQh = q.permute(0, 2, 3, 1, 4).reshape(k_seqs * ng, rep * width, hn)
    k_GhL = keys.reshape(k_seqs * ng, length, hn).transpose(1, 2)
    scores = torch.bmm(q_GQh.float(), k_GhL.float()).view(k_seqs, ng, rep, width, length)
    scores = (scores * scale).masked_fill(blocked[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(k_seqs * ng, rep * width, length)
    out = torch.bmm(probs, values.reshape(k_seqs * ng, length, hn))
    out = out.view(k_seqs, ng, rep, width, hn).permute(0, 3, 1, 2, 4)  # [k, width, ng, rep, hn]
    return out[step.seq, step.local].reshape(step.seq.size(0), -1)


def _rope(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[T, ng, heads, hn]`` with per-token tables ``[T, 1, 1, rot]``: Megatron's
    non-interleaved ``t * cos + cat(-x2, x1) * sin`` written as ``t * cos + cat(x2, x1) *
    signed_sin`` (the same products; three ops instead of six); dims beyond ``rot`` pass
    through. The halves are swapped with ``cat``, not ``roll`` (the same values): inductor
    compiles a ``roll`` to a per-element gather (docs/measurements/engine.md)."""
    rot = cos.size(-1)
    head, tail = t[..., :rot], t[..., rot:]
    swapped = torch.cat((head[..., rot // 2 :], head[..., : rot // 2]), dim=-1)
    rotated = torch.addcmul(head * cos, swapped, signed_sin)
    return rotated if tail.numel() == 0 else torch.cat((rotated, tail), dim=-1)


def _bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A row-parallel layer's bias, added after the TP reduction (as Megatron does)."""
    return out if bias is None else out + bias
