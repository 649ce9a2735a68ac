"""What every layer's packed (thd) attention needs, computed once per micro-batch on the host.

A packed micro-batch's boundaries are Python ints before the batch goes to the device
(``training.microbatch.thd_micro_batch`` computes them). ``HostPackedSeqParams`` is Megatron's
``PackedSeqParams`` carrying them as ints too, so that nothing downstream reads the device
``cu_seqlens`` back: on a GPU each such read (``.tolist()``, ``torch.equal``, ``int(cu[-1])``)
waits for the device, and the attention and RoPE read them in every layer.

- ``host_bounds(params)``: the padded boundaries and the samples' real lengths, from the ints
  when the params carry them, else read from the device once (Megatron's own ``PackedSeqParams``).
- ``plan_packed_attention(bounds)`` (pure): the sequences of a packed row grouped for padded
  batched attention (``tree_attention.padding_groups``) with the index tensors that gather a group
  into ``[k, width]`` rows; ``HostPackedSeqParams.attention_plan()`` moves it to the device
  once per micro-batch (the first layer asks; the others reuse it).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_earl import runtime
from megatron_earl.models.tree_attention import padding_groups


@dataclass(frozen=True)
class PaddedGroup:
    """Sequences attended together, right-padded to ``width`` (module docstring)."""

    spans: tuple[tuple[int, int], ...]
    """(start, end) of each sequence in the packed row."""
    width: int
    """The longest sequence's tokens."""
    seq: torch.Tensor
    """[n] int64: the group row of each of the group's tokens."""
    local: torch.Tensor
    """[n] int64: each token's position in its row."""
    tokens: torch.Tensor
    """[n] int64: each token's position in the packed row."""


@dataclass(frozen=True)
class PackedAttentionPlan:
    """A packed row's sequences in attention order: a (start, end) span attended alone or a
    ``PaddedGroup``."""

    parts: tuple[tuple[int, int] | PaddedGroup, ...]

    def to_device(self) -> PackedAttentionPlan:
        """The plan with its index tensors on the compute device (boundary "packing
        metadata", docs/devices.md)."""
        parts = [
            part
            if not isinstance(part, PaddedGroup)
            else PaddedGroup(
                part.spans,
                part.width,
                *(runtime.to_device(t) for t in (part.seq, part.local, part.tokens)),
            )
            for part in self.parts
        ]
        return PackedAttentionPlan(tuple(parts))


def plan_packed_attention(bounds: Sequence[int]) -> PackedAttentionPlan:
    """The attention plan of a packed row with boundaries ``bounds`` (empty sequences skipped);
    pure, host tensors."""
    segments = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    parts: list[tuple[int, int] | PaddedGroup] = []
    for group in padding_groups([b - a for a, b in segments]):
        spans = tuple(segments[i] for i in group)
        if len(spans) == 1:
            parts.append(spans[0])
            continue
        parts.append(
            PaddedGroup(
                spans,
                max(b - a for a, b in spans),
                torch.cat([torch.full((b - a,), j) for j, (a, b) in enumerate(spans)]),
                torch.cat([torch.arange(b - a) for a, b in spans]),
                torch.cat([torch.arange(a, b) for a, b in spans]),
            )
        )
    return PackedAttentionPlan(tuple(parts))


@dataclass(kw_only=True)
class HostPackedSeqParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` of a packed (thd) micro-batch with its boundaries as host
    ints (``cu_seqlens_*_padded`` and ``cu_seqlens_*`` hold the same values on the device);
    built by ``training.microbatch.thd_micro_batch``."""

    bounds: tuple[int, ...]
    """The padded cumulative lengths (``cu_seqlens_q_padded``), global under CP."""
    lengths: tuple[int, ...]
    """The samples' real lengths (``cu_seqlens_q`` differenced)."""
    _plan: list[PackedAttentionPlan] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    """The attention plan once made (``attention_plan``)."""

    def attention_plan(self) -> PackedAttentionPlan:
        """``plan_packed_attention(bounds)`` on the compute device, made once per micro-batch
        (every layer asks)."""
        if not self._plan:
            self._plan.append(plan_packed_attention(self.bounds).to_device())
        return self._plan[0]


def host_bounds(params: PackedSeqParams) -> tuple[list[int], list[int]]:
    """(padded cumulative lengths, real lengths) of a packed batch: the host ints of
    ``HostPackedSeqParams``, else one read of each device tensor (a sync each on a GPU)."""
    if isinstance(params, HostPackedSeqParams):
        return list(params.bounds), list(params.lengths)
    real = params.cu_seqlens_q.tolist()
    padded = real if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded.tolist()
    return [int(x) for x in padded], [b - a for a, b in itertools.pairwise(real)]
