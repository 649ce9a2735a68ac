"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (local, non-TE spec).

Megatron's local ``DotProductAttention`` materialises a [b * heads, s, s] score matrix, rejects
packed sequences and context parallelism. This module is a drop-in ``core_attention`` submodule
(same constructor and forward signature) that calls SDPA, which on CPU and GPU runs a
flash/memory-efficient kernel for causal attention without an explicit mask, so a 32K-token
sequence never allocates an s x s tensor per head.

Shapes (Megatron's conventions; legend: s = sequence, b = batch, t = packed tokens,
np = query heads per TP rank, ng = query groups per TP rank, hn = head dim):
- sbhd: query [s, b, np, hn], key/value [s, b, ng, hn] -> [s, b, np * hn]
- thd (packed, ``packed_seq_params.qkv_format == "thd"``): query [t, np, hn] -> [t, np * hn];
  sequence boundaries from ``cu_seqlens_q`` (padded variants preferred when given; their host
  ints and the attention plan made once per micro-batch with ``HostPackedSeqParams``,
  ``models.packed_attention``: no device read per layer); a
  prefix-tree row (``tree_attention.TreePackedSeqParams``, ``training.prefix_tree``) instead
  follows its precomputed plan: batches of rows gathered and attended under their masks, each
  branch over its shared prefix then itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from megatron_earl.models import tree_attention
from megatron_earl.models.packed_attention import (
    HostPackedSeqParams,
    PaddedGroup,
    plan_packed_attention,
)
from megatron_earl.models.tree_attention import TreeAttention


def packed_bounds(params: PackedSeqParams, who: str) -> list[int]:
    """Sequence boundaries of a packed (thd) self-attention batch (padded ones when given): the
    host ints of ``HostPackedSeqParams`` (``training.microbatch``), else read from the device
    (Megatron's own ``PackedSeqParams``: two syncs on a GPU, in every layer)."""
    if isinstance(params, HostPackedSeqParams):
        return list(params.bounds)
    cu_q = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
    cu_kv = (
        params.cu_seqlens_kv if params.cu_seqlens_kv_padded is None else params.cu_seqlens_kv_padded
    )
    if not torch.equal(cu_q, cu_kv):
        raise ValueError(f"{who} (self-attention) needs cu_seqlens_q == cu_seqlens_kv")
    return [int(x) for x in cu_q.tolist()]


class SDPAttention(MegatronModule):
    """Causal GQA core attention on SDPA; supports packed (thd) sequences."""

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
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"SDPAttention got context_parallel_size={config.context_parallel_size}; use "
                "megatron_earl.models.cp_attention.ContextParallelSDPAttention for cp > 1"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported by SDPAttention")
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def _dropout_p(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q [b, np, sq, hn], k/v [b, ng, sk, hn] -> [b, np, sq, hn]."""
        k, v = _repeat_kv(q, k, v)
        return self._attend_repeated(q, k, v, mask)

    def _attend_repeated(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """``_attend`` with k/v already at np heads."""
        dropout_p = self._dropout_p()
        if dropout_p > 0:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self._sdpa(q, k, v, mask, dropout_p)
        return self._sdpa(q, k, v, mask, 0.0)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, p: float) -> Tensor:
        if mask is None:
            sq, sk = q.size(2), k.size(2)
            if sq != sk and sq != 1:
                # Queries are the last sq positions of the keys (prefill after a cached prefix):
                # causal alignment is bottom-right, which SDPA's is_causal does not do.
                pos_q = torch.arange(sk - sq, sk, device=q.device)
                mask = pos_q[:, None] >= torch.arange(sk, device=q.device)[None, :]
            else:
                return F.scaled_dot_product_attention(
                    q, k, v, dropout_p=p, is_causal=sq > 1, scale=self.softmax_scale
                )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, scale=self.softmax_scale
        )

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
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPAttention")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_packed(query, key, value, packed_seq_params)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None
        if attention_mask is not None:
            # Megatron's mask is True where attention is NOT allowed; SDPA wants True = keep.
            mask = ~attention_mask.to(torch.bool)
        out = self._attend(q, k, v, mask)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _forward_packed(
        self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams
    ) -> Tensor:
        if tree_attention.is_tree(params):
            return self._forward_tree(query, key, value, params.prefix_tree)
        if isinstance(params, HostPackedSeqParams):  # made once per micro-batch
            plan = params.attention_plan()
        else:
            plan = plan_packed_attention(packed_bounds(params, type(self).__name__)).to_device()
        out = torch.zeros_like(query)
        for part in plan.parts:
            if not isinstance(part, PaddedGroup):  # [t, h, d] -> [1, h, t, d]
                a, b = part
                q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                out[a:b] = self._attend(q, k, v, None).squeeze(0).transpose(0, 1)
                continue
            # Right-padded [k, h, width, d]: causal attention never lets a real query see the
            # padding after it; the padded queries' outputs are dropped.
            seq, local, tokens = part.seq, part.local, part.tokens
            q, k, v = (
                x.new_zeros(len(part.spans), part.width, *x.shape[1:]).index_put(
                    (seq, local), x[tokens]
                )
                for x in (query, key, value)
            )
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            out[tokens] = self._attend(q, k, v, None).transpose(1, 2)[seq, local]
        return out.reshape(query.size(0), -1)

    def _forward_tree(
        self, query: Tensor, key: Tensor, value: Tensor, tree: TreeAttention
    ) -> Tensor:
        """A prefix-tree row (``models.tree_attention``): each batch of rows is gathered into
        [R, h, W, d] queries and [R, g, K, d] keys/values, attended under its mask in one call;
        large rows one by one."""
        out = torch.zeros_like(query)
        for batch in tree.batches:
            q = query[batch.queries].transpose(1, 2)
            k, v = (x[batch.keys].transpose(1, 2) for x in (key, value))
            attended = self._attend(q, k, v, batch.mask).transpose(1, 2)
            out[batch.tokens] = attended.flatten(0, 1)[batch.picks]
        for row in tree.large:
            self._attend_row(query, key, value, row, out)
        return out.reshape(query.size(0), -1)

    def _attend_row(
        self, query: Tensor, key: Tensor, value: Tensor, row: tree_attention.Row, out: Tensor
    ) -> None:
        """One large tree row: its queries over ``[prefix keys; own keys]``, bottom-right causal,
        in chunks whose [rows, keys] mask stays within ``tree_attention.MASK_ELEMENTS``; the keys
        and values are repeated to the query heads once (chunks slice views of them)."""
        (p0, p1), (a, b) = row.prefix, row.own
        q = query[a:b].transpose(0, 1).unsqueeze(0)
        k, v = (torch.cat([x[p0:p1], x[a:b]]).transpose(0, 1).unsqueeze(0) for x in (key, value))
        k, v = _repeat_kv(q, k, v)
        f, n = p1 - p0, b - a
        step = n if f == 0 else max(1, tree_attention.MASK_ELEMENTS // (f + n))  # f = 0: causal
        parts = []
        for j in range(0, n, step):
            keys = slice(0, f + j + step)
            rows = q[:, :, j : j + step]
            parts.append(self._attend_repeated(rows, k[:, :, keys], v[:, :, keys], None))
        out[a:b] = torch.cat(parts, dim=2).squeeze(0).transpose(0, 1)


def _repeat_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """k/v [b, ng, sk, hn] repeated to q's np heads (GQA)."""
    rep = q.size(1) // k.size(1)
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return k, v
