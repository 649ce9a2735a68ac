"""The attention plan of a prefix-tree row (``training.prefix_tree``), made once per micro-batch.

A tree row is a list of attention **rows**: each has its own tokens (a span of the packed row)
and a prefix span it continues (empty for a plain sample or a shared prefix itself). A row's
queries are its own tokens; its keys are the prefix's tokens then its own, causal aligned
bottom-right: own token j sees the prefix and own tokens 0..j.

The plan gathers rows into padded batches, one SDPA call each (``SDPAttention`` runs them): row
r of a batch reads queries ``query[queries[r]]`` [W] and keys ``key[keys[r]]`` [K] with
``mask[r]`` [W, K] (True = attend); a shared prefix's keys are gathered into every row that
continues it, so their gradients sum over those rows. Rows with a prefix and rows without are
batched apart (the latter need no mask: SDPA's causal one is theirs). Rows are grouped by key
length, then each group by query length, each step with at most ``max_waste`` padding
(``padding_groups``; the second step can leave a batch more key padding than that), and a batch
holds at most ``MASK_ELEMENTS`` [query, key] pairs; a row with more is ``large`` and runs alone,
its queries in chunks (``SDPAttention._attend_row``), so long contexts never build a big mask.

Every index is built here on the host from Python ints and moved to the compute device once per
micro-batch (boundary "packing metadata", docs/devices.md); the layers only gather.

A tree row reaches the model as ``TreePackedSeqParams`` (``is_tree``): Megatron's
``PackedSeqParams`` with one ``thd`` sequence of the whole row (what Megatron's RoPE reads), plus
this plan, the tokens' positions and the way back to the samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_earl import runtime

MASK_ELEMENTS = 1 << 22
"""Most [query, key] pairs of one tree attention call (a mask of 16 MiB as fp32)."""

Span = tuple[int, int]
"""``[start, end)`` of tokens in a packed row."""


@dataclass(frozen=True)
class Row:
    """One attention row: ``own`` tokens attend ``prefix`` then themselves causally."""

    prefix: Span
    own: Span

    @property
    def num_keys(self) -> int:
        return (self.prefix[1] - self.prefix[0]) + (self.own[1] - self.own[0])


@dataclass(frozen=True)
class AttentionBatch:
    """Rows attended in one padded SDPA call (R rows, W queries, K keys each)."""

    queries: torch.Tensor
    """[R, W] int64: packed index of each row's queries (padding repeats a real index)."""
    keys: torch.Tensor
    """[R, K] int64: packed index of each row's keys (prefix, then own; padding as above)."""
    mask: torch.Tensor | None
    """[R, 1, W, K] bool: True where the query attends the key; None when no row has a prefix
    (then W = K and SDPA's own causal masking is the mask: padding only follows real tokens)."""
    picks: torch.Tensor
    """[n] int64: flat ``r * W + j`` of every real query."""
    tokens: torch.Tensor
    """[n] int64: its packed index (where the output goes)."""

    def to_device(self) -> AttentionBatch:
        mask = None if self.mask is None else runtime.to_device(self.mask)
        return AttentionBatch(
            runtime.to_device(self.queries),
            runtime.to_device(self.keys),
            mask,
            runtime.to_device(self.picks),
            runtime.to_device(self.tokens),
        )


@dataclass(frozen=True)
class TreeAttention:
    """The attention plan of a tree row."""

    batches: tuple[AttentionBatch, ...]
    large: tuple[Row, ...]
    """Rows too large for a batch: attended one by one, queries chunked."""

    def to_device(self) -> TreeAttention:
        return TreeAttention(tuple(b.to_device() for b in self.batches), self.large)


def _batch(rows: list[Row]) -> AttentionBatch:
    """The padded indices of ``rows``, built for all rows at once (a few tensor ops, not a few
    per row)."""
    spans = [(r.own[0], r.own[1] - r.own[0], r.prefix[0], r.prefix[1] - r.prefix[0]) for r in rows]
    # per row [R, 1]: own start, own length, prefix start, prefix length
    own0, n, p0, f = torch.tensor(spans, dtype=torch.long).T[:, :, None]
    width, num_keys = int(n.max()), int((f + n).max())
    j, k = torch.arange(width)[None, :], torch.arange(num_keys)[None, :]
    queries = own0 + torch.minimum(j, n - 1)  # padding repeats the row's last query
    k = torch.minimum(k, f + n - 1)  # ... and its last key
    keys = torch.where(k < f, p0 + k, own0 + k - f)
    limit = f + j
    real = j < n
    picks = (torch.arange(len(rows))[:, None] * width + j)[real]
    tokens = (own0 + j)[real]
    mask = None
    if bool((f > 0).any()):
        mask = (torch.arange(num_keys)[None, None, :] <= limit[:, :, None]).unsqueeze(1)
    return AttentionBatch(queries, keys, mask, picks, tokens)


def plan_tree_attention(rows: list[Row]) -> TreeAttention:
    """Batches of ``rows`` (module doc): grouped by key length, then by query length, each
    batch's mask within ``MASK_ELEMENTS``; a row whose own mask exceeds it is ``large``."""
    max_elements = MASK_ELEMENTS
    rows = [r for r in rows if r.own[1] > r.own[0]]
    batches: list[AttentionBatch] = []
    large: list[Row] = []
    plain = [r for r in rows if r.prefix[1] == r.prefix[0]]
    branches = [r for r in rows if r.prefix[1] > r.prefix[0]]
    for kind in (plain, branches):  # a batch of plain rows needs no mask
        for by_keys in padding_groups([r.num_keys for r in kind]):
            similar = [kind[i] for i in by_keys]  # then by queries (a plain row's are its keys)
            for group in padding_groups([r.own[1] - r.own[0] for r in similar]):
                _fill(similar, group, max_elements, batches, large)
    return TreeAttention(tuple(batches), tuple(large))


def _fill(
    rows: list[Row],
    group: list[int],
    max_elements: int,
    batches: list[AttentionBatch],
    large: list[Row],
) -> None:
    """Batches of ``rows[i] for i in group`` within ``max_elements`` each (rows alone over it go
    to ``large``)."""
    chosen: list[Row] = []
    width = keys = 0  # the longest queries and keys of ``chosen``
    for r in (rows[i] for i in group):
        n = r.own[1] - r.own[0]
        if n * r.num_keys > max_elements:
            large.append(r)
            continue
        if chosen and (len(chosen) + 1) * max(width, n) * max(keys, r.num_keys) > max_elements:
            batches.append(_batch(chosen))
            chosen, width, keys = [], 0, 0
        chosen.append(r)
        width, keys = max(width, n), max(keys, r.num_keys)
    if chosen:
        batches.append(_batch(chosen))


@dataclass(kw_only=True)
class TreePackedSeqParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` of a tree row (``cu_seqlens`` ``[0, t]``: one ``thd``
    sequence for RoPE) with what the tree adds; built by ``training.prefix_tree``."""

    prefix_tree: TreeAttention
    """Which tokens attend which (``attention.SDPAttention`` reads it)."""
    token_positions: torch.Tensor
    """[t] int64: every token's position in its sample (``gpt.GPTModel`` reads it)."""
    unshared_index: torch.Tensor
    """[sum(sample_lengths)] int64: each sample token's row position, in unshared packed order
    (``training.microbatch.real_tokens`` reads results through it)."""
    sample_lengths: tuple[int, ...]
    """The samples' lengths, in micro-batch order."""
    num_shared_tokens: int
    """Tokens of the samples the row holds once instead of once per sample (sum(sample_lengths)
    minus the row's tokens, padding excluded)."""


def is_tree(params: PackedSeqParams | None) -> bool:
    """Whether ``params`` describe a prefix-tree row."""
    return isinstance(params, TreePackedSeqParams)


def padding_groups(lengths: list[int], max_waste: float = 0.25) -> list[list[int]]:
    """Indices of ``lengths`` grouped for padded batched attention: longest first, a sequence
    joins the current group while the group's padded tokens stay within ``1 + max_waste`` of its
    real tokens (a long-tail sequence is attended alone; equal lengths are one group)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups:
            width = lengths[groups[-1][0]]
            if width * (len(groups[-1]) + 1) <= (1 + max_waste) * (real + lengths[i]):
                groups[-1].append(i)
                real += lengths[i]
                continue
        groups.append([i])
        real = lengths[i]
    return groups
