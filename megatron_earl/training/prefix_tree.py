"""Prefix-shared packing: a GRPO group's prompt computed once in the train and log-prob passes.

The samples of one prompt (a group) begin with the same prompt tokens. Packed one after another
(``microbatch.thd_micro_batch``) the model computes that prompt once per sample; packed as a
**tree** it computes it once per micro-batch, and each sample adds only its own branch:

    unshared row:  [p0 p1 p2 p3 a0 a1 a2] [p0 p1 p2 p3 b0 b1] ...
    tree row:      [p0 p1 p2] [p3 a0 a1 a2] [p3 b0 b1] ...
                    prefix     branch a      branch b

The prefix is the prompt without its last token: the last prompt position predicts the sample's
own first generated token, so it opens every branch (its label differs per sample). A branch's
positions continue the prefix's (``p3`` is at position 3 in every branch), and its tokens attend
the prefix then their own branch, causally (``models.attention.SDPAttention``); RoPE takes the
per-token positions (``models.gpt.GPTModel``). Every prefix position has ``loss_mask`` 0 and the
same input, position and label in all members, so its values (hidden states, log-probs) are the
members' own: the results of a tree row are the unshared row's, only computed once.

What is shared: samples of one micro-batch whose tokens agree up to and including the first
trainable position ``f`` (the first with ``loss_mask != 0``), ``f >= 1``; the prefix is then
``f`` tokens. Samples with nothing to train, or no partner, are packed whole (a plain segment).

A tree micro-batch has the keys of ``thd_micro_batch``'s (``tokens``, ``labels``, ``loss_mask``,
the other fields, ``seq_ids``, ``position_ids``, ``packed_seq_params``, ``sample_index``) over
the tree row. Prefix tokens belong to the group's first sample (``seq_ids``); their loss mask is
0, so per-sample sums are unchanged. ``packed_seq_params`` is a ``TreePackedSeqParams``: one
``thd`` sequence of the whole row for RoPE (``cu_seqlens`` ``[0, t]``, per-token positions in
``token_positions``), the tree for the attention (``prefix_tree``) and, for every token of the
samples in their unshared packed order, its position in the tree row (``unshared_index``:
``microbatch.real_tokens`` and ``unpack_per_sample`` read results through it).

Where it applies: cp = 1 (with cp > 1 every sample is cut into CP chunks; trees are not), no
dropout, on the local spec's ``SDPAttention``; sequence parallelism pads the row's end like
``thd_micro_batch``. ``orchestration.samples.shares_prefixes`` decides per phase (with
``models.gpt.tree_ready`` for the built model); the loop packs whole samples otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from megatron_earl import runtime
from megatron_earl.models.tree_attention import Row, TreePackedSeqParams, plan_tree_attention
from megatron_earl.parallel.cp import sequence_parallel_padding
from megatron_earl.training.microbatch import INT_FIELDS, MicroBatchError


@dataclass(frozen=True)
class TreeLayout:
    """Where every token of a tree row comes from (pure plan; host tensors)."""

    rows: tuple[Row, ...]
    """The attention rows: shared prefixes and unshared samples alone, branches on their prefix."""
    source: torch.Tensor
    """[t - padding] int64: each row position's index in the samples' unshared concatenation."""
    positions: torch.Tensor
    """[t] int64: each row position's position in its sample (padding counts from 0)."""
    slots: torch.Tensor
    """[t] int64: each row position's sample slot (a prefix's: its group's first sample)."""
    unshared_index: torch.Tensor
    """[sum(lengths)] int64: each sample token's row position, in unshared packed order."""

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())


def shared_prefixes(
    tokens: torch.Tensor, loss_mask: torch.Tensor, lengths: Sequence[int]
) -> tuple[list[list[int]], list[int]]:
    """The groups of samples that share a prefix, and each group's prefix length.

    ``tokens`` and ``loss_mask`` are the samples' fields back to back (host tensors of
    ``sum(lengths)`` tokens). Returns a partition of the sample slots (groups ordered by their
    first slot, slots ascending inside) and per group the shared length ``f`` (0 for a sample
    packed whole): samples with equal ``tokens[:f + 1]`` where ``f >= 1`` is each one's first
    trainable position.
    """
    # each sample's first trainable position, vectorised (0 when it has none)
    counts = torch.tensor(list(lengths))
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
    never = int(counts.max())
    first = torch.full((len(lengths),), never).scatter_reduce(
        0,
        torch.repeat_interleave(torch.arange(len(lengths)), counts),
        local.masked_fill(loss_mask == 0, never),
        "amin",
    )
    first = first.masked_fill(first == never, 0).tolist()
    token_bytes = tokens.to(torch.int64).numpy()
    members: dict[object, list[int]] = {}
    for slot, (start, f) in enumerate(zip(starts.tolist(), first, strict=True)):
        key = (f, token_bytes[start : start + f + 1].tobytes()) if f >= 1 else slot
        members.setdefault(key, []).append(slot)
    pairs = sorted(
        (group, key[0] if isinstance(key, tuple) and len(group) > 1 else 0)
        for key, group in members.items()
    )
    groups, prefix = [g for g, _ in pairs], [f for _, f in pairs]
    return groups, prefix


def plan_tree(
    lengths: Sequence[int], groups: Sequence[Sequence[int]], prefix: Sequence[int], padding: int = 0
) -> TreeLayout:
    """The tree row of samples of ``lengths``: ``groups`` (a partition of the slots, in row order)
    with their shared prefix lengths (0: every member packed whole), then ``padding`` tokens."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    if sorted(s for g in groups for s in g) != list(range(len(lengths))):
        raise ValueError(f"groups {list(groups)} are not a partition of {len(lengths)} samples")
    source: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    rows: list[Row] = []
    unshared = torch.empty(starts[-1], dtype=torch.long)
    row = 0

    def place(slot: int, first: int, end: int) -> tuple[int, int]:
        nonlocal row
        n = end - first
        source.append(torch.arange(starts[slot] + first, starts[slot] + end))
        positions.append(torch.arange(first, end))
        slots.append(torch.full((n,), slot))
        span = (row, row + n)
        row += n
        return span

    for group, f in zip(groups, prefix, strict=True):
        if f == 0 or len(group) == 1:
            for slot in group:
                span = place(slot, 0, lengths[slot])
                unshared[starts[slot] : starts[slot + 1]] = torch.arange(*span)
                rows.append(Row((span[0], span[0]), span))
            continue
        if not all(0 < f < lengths[slot] for slot in group):
            raise ValueError(
                f"prefix of {f} tokens for samples of lengths {[lengths[s] for s in group]}: "
                "each sample needs at least one token after its prefix"
            )
        shared = place(group[0], 0, f)
        rows.append(Row((shared[0], shared[0]), shared))
        for slot in group:
            span = place(slot, f, lengths[slot])
            unshared[starts[slot] : starts[slot] + f] = torch.arange(*shared)
            unshared[starts[slot] + f : starts[slot + 1]] = torch.arange(*span)
            rows.append(Row(shared, span))
    if padding:
        positions.append(torch.arange(padding))
        slots.append(torch.full((padding,), groups[-1][-1]))
        rows.append(Row((row, row), (row, row + padding)))
    return TreeLayout(
        rows=tuple(rows),
        source=torch.cat(source),
        positions=torch.cat(positions),
        slots=torch.cat(slots),
        unshared_index=unshared,
    )


def tree_micro_batch(
    fields: Mapping[str, torch.Tensor],
    lengths: Sequence[int],
    sample_index: Sequence[int] | None = None,
    sp: int = 1,
) -> dict[str, object]:
    """The tree micro-batch (module doc) of samples held back to back, cp = 1.

    ``fields`` are 1-D per-token tensors ``[sum(lengths)]`` with at least ``tokens`` and
    ``loss_mask``; ``sample_index`` labels the samples (default ``0..n-1``); ``sp`` > 1 pads the
    row's end so it splits over ``sp`` sequence-parallel ranks (token 0, mask 0, zeros).
    """
    if not lengths:
        raise MicroBatchError("a micro-batch needs at least one sample")
    # The plan is read by Python from the host copy of two fields ("packing metadata",
    # docs/devices.md); the fields themselves are gathered on their device.
    groups, prefix = shared_prefixes(
        runtime.to_host(fields["tokens"]), runtime.to_host(fields["loss_mask"]), lengths
    )
    num_shared = sum(f * (len(g) - 1) for g, f in zip(groups, prefix))
    padding = sequence_parallel_padding([sum(lengths) - num_shared], 1, sp)
    layout = plan_tree(lengths, groups, prefix, padding)
    source = runtime.to_device(layout.source)
    out: dict[str, object] = {}
    for name, t in fields.items():
        t = runtime.to_device(t.long() if name in INT_FIELDS else t.float())[source]
        if padding:
            t = torch.cat([t, t.new_zeros(padding)])
        out[name] = t.unsqueeze(0)
    positions = runtime.to_device(layout.positions)
    out["seq_ids"] = runtime.to_device(layout.slots).unsqueeze(0)
    out["position_ids"] = positions.unsqueeze(0)
    bounds = runtime.to_device(torch.tensor([0, layout.num_tokens], dtype=torch.int32))
    longest = int(layout.positions.max()) + 1
    out["packed_seq_params"] = TreePackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        cu_seqlens_q_padded=bounds,
        cu_seqlens_kv_padded=bounds,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        prefix_tree=plan_tree_attention(list(layout.rows)).to_device(),
        token_positions=positions,
        unshared_index=runtime.to_device(layout.unshared_index),
        sample_lengths=tuple(lengths),
        num_shared_tokens=num_shared,
    )
    index = range(len(lengths)) if sample_index is None else sample_index
    out["sample_index"] = torch.tensor(list(index), dtype=torch.long)
    return out
