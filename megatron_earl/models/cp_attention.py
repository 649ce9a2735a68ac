"""Context-parallel core attention on SDPA, without Transformer Engine.

Megatron-Core implements context parallelism (CP) only inside ``TEDotProductAttention``; its local
spec raises for cp > 1. ``ContextParallelSDPAttention`` is a drop-in ``core_attention`` submodule
(same constructor and forward signature as ``SDPAttention``) for the local/SDPA spec.

Layout of the tokens (Megatron's load-balanced scheme, ``megatron_earl.parallel.cp``): each
sequence is cut into 2 x cp chunks of L tokens; CP rank r holds chunks r and 2cp-1-r, in that order.
Packed (thd) batches are chunked per sequence, each padded to a multiple of 2 x cp
(``cu_seqlens_*_padded`` are the *global* cumulative lengths, as Megatron passes them).

Communication: **all-gather of K/V over the CP group** (one collective per layer, K and V sent
together). Every rank then rebuilds the sequence's K/V in global order and attends its two query
chunks: chunk c sees keys [0, (c + 1) L) with causal masking aligned on global positions (the chunk
is the last L positions of that key range; SDPA's ``is_causal`` when c == 0). The backward of the
all-gather is a reduce-scatter of dK/dV over the CP group (``_GatherKV``), so forward and backward
are exact: the same sums as CP=1, only split differently. GQA: only the ng key/value heads travel;
they are repeated to np heads after the gather.

Why all-gather and not a ring: a ring exchanges K/V blocks cp - 1 times and must merge partial
softmaxes through their log-sum-exp, which public SDPA does not return (it would need
backend-specific private kernels for forward and backward). The all-gather uses only public SDPA,
is exact, and sends the same bytes as a ring in one step.

Memory cost (per layer, per micro-batch): the gathered K/V of the whole sequence,
2 x s x b x ng x hn elements (cp times the local K/V), is kept for backward; with GQA this is small
next to the local queries and MLP activations (e.g. ng = np / 4: the gathered K/V equal the local
query activations at cp = 2). Chunk c's causal mask is a [L, (c + 1) L] boolean tensor (CPU SDPA
converts it to the activation dtype): about 2 x cp x L^2 elements per layer in total, the price of
not using a ring with log-sum-exp merging. On GPU the ring (or TE) is the scalable choice for very
long contexts; with TE present Megatron's own CP attention is used instead of this module.

Which ranks call ``forward``: every rank of the CP group (``pg_collection.cp``), layer by layer in
the same order (the all-gather in forward, the reduce-scatter in backward).

Shapes (s = local tokens of a sequence, S = cp x s, b = batch, t = local packed tokens, np/ng =
query heads/groups per TP rank, hn = head dim): sbhd query [s, b, np, hn], key/value
[s, b, ng, hn] -> [s, b, np * hn]; thd query [t, np, hn] -> [t, np * hn].
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megatron_earl.models.attention import SDPAttention, packed_bounds
from megatron_earl.parallel.cp import check_cp_length


class _GatherKV(torch.autograd.Function):
    """All-gather along a new leading dim over the CP group; backward reduce-scatters the grads.

    Which ranks call: every rank of ``group``, with tensors of the same shape.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((group.size(), *x.shape))
        dist.all_gather(list(out.unbind(0)), x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        group = ctx.group
        if grad.is_cuda and "nccl" in str(dist.get_backend(group)):
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad.contiguous().flatten(0, 1), group=group)
            return out, None
        # gloo has no reduce-scatter: all-reduce a copy (autograd may share ``grad``) and keep this
        # rank's slice; the same sum, cp times the bytes.
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total[group.rank()], None


def _to_global_order(gathered: Tensor) -> Tensor:
    """[cp, 2L, ...] (rank r holds chunks r, 2cp-1-r) -> [2cp L, ...] in sequence order."""
    halves = gathered.unflatten(1, (2, gathered.size(1) // 2))
    first = halves[:, 0].flatten(0, 1)  # chunks 0 .. cp-1
    second = halves[:, 1].flip(0).flatten(0, 1)  # chunks cp .. 2cp-1
    return torch.cat([first, second])


class ContextParallelSDPAttention(SDPAttention):
    """Causal GQA core attention for cp > 1: all-gathered K/V, load-balanced chunks, sbhd and thd.

    ``cp_comm_type`` is accepted for signature compatibility and ignored: this module always
    all-gathers K/V (exact whatever the choice; see the module docstring).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        # SDPAttention is the per-rank kernel; it rejects cp > 1 configs, so it sees a cp=1 copy.
        local_config = copy.copy(config)
        local_config.context_parallel_size = 1
        super().__init__(
            local_config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            pg_collection=pg_collection,
        )
        self.config = config
        self.cp_group = pg_collection.cp
        self.cp = self.cp_group.size()
        self.cp_rank = self.cp_group.rank()

    def _gather_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """[n, ...] local key/value (n = tokens on dim 0) -> gathered [cp, n, ...] each."""
        hk = key.size(-1)
        gathered = _GatherKV.apply(torch.cat([key, value], dim=-1), self.cp_group)
        return gathered[..., :hk], gathered[..., hk:]

    def _attend_chunks(
        self, q: Tensor, k_full: Tensor, v_full: Tensor, mask: Tensor | None
    ) -> Tensor:
        """Local q [b, np, 2L, hn] against global k/v [b, ng, 2cp L, hn] -> [b, np, 2L, hn].

        ``mask`` (Megatron: True = masked out) is [b or 1, 1, 2L, 2cp L] with global key columns.
        """
        chunk = q.size(2) // 2
        outs = []
        for j, c in enumerate((self.cp_rank, 2 * self.cp - 1 - self.cp_rank)):
            rows, keys = slice(j * chunk, (j + 1) * chunk), slice(0, (c + 1) * chunk)
            sub_mask = None if mask is None else ~mask[:, :, rows, keys].to(torch.bool)
            k, v = k_full[:, :, keys], v_full[:, :, keys]
            outs.append(self._attend(q[:, :, rows], k, v, sub_mask))
        return torch.cat(outs, dim=2)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """Which ranks call: every rank of the CP group (collective inside)."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by ContextParallelSDPAttention")
        if query.size(0) != key.size(0):
            raise ValueError(
                f"ContextParallelSDPAttention needs as many queries as keys per rank (got "
                f"{query.size(0)} and {key.size(0)}); KV-cache decoding with cp > 1 is unsupported"
            )
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_packed(query, key, value, packed_seq_params)
        check_cp_length(query.size(0) * self.cp, self.cp)
        k_all, v_all = self._gather_kv(key, value)
        # [cp, s, b, g, d] -> [S, b, g, d] -> [b, g, S, d]
        k_full, v_full = (_to_global_order(x).permute(1, 2, 0, 3) for x in (k_all, v_all))
        q = query.permute(1, 2, 0, 3)
        out = self._attend_chunks(q, k_full, v_full, attention_mask)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _forward_packed(
        self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams
    ) -> Tensor:
        bounds = packed_bounds(params, type(self).__name__)
        if bounds[-1] != query.size(0) * self.cp:
            raise ValueError(
                f"packed cu_seqlens end at {bounds[-1]} tokens but this rank holds "
                f"{query.size(0)} = {bounds[-1]} / cp ({self.cp}) expected; cu_seqlens must be "
                "the global (padded) boundaries"
            )
        k_all, v_all = self._gather_kv(key, value)
        outs = []
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            if end == start:
                continue
            check_cp_length(end - start, self.cp, what=f"padded length of packed sequence {i}")
            local = slice(start // self.cp, end // self.cp)
            # [t, h, d] -> [1, h, t, d]
            q = query[local].transpose(0, 1).unsqueeze(0)
            k_full, v_full = (
                _to_global_order(x[:, local]).transpose(0, 1).unsqueeze(0) for x in (k_all, v_all)
            )
            outs.append(self._attend_chunks(q, k_full, v_full, None).squeeze(0).transpose(0, 1))
        out = torch.cat(outs) if outs else torch.zeros_like(query)
        return out.reshape(query.size(0), -1)
