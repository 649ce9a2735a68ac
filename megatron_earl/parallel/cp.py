"""Context-parallel (CP) sequence chunking: pure helpers, no communication.

Megatron's load-balanced scheme: a sequence of length ``s`` is cut into ``2 * cp`` equal chunks and
CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (in that order), so every rank gets the
same amount of causal-attention work. Packed (thd) batches are chunked the same way *per sequence*,
each sequence padded to a multiple of ``2 * cp`` first (``cu_seqlens_padded``).

- ``cp_chunk_bounds``: the two [start, end) token ranges of a rank.
- ``cp_token_index`` / ``packed_cp_token_index``: the token positions a rank holds, in local order.
- ``split_batch_for_cp``: a micro-batch dict (token dim 1) -> this rank's share, like Megatron-LM's
  ``get_batch_on_this_cp_rank``; ``merge_cp_shards`` is its inverse (tests, log-prob gathering).
- ``cp_padded_length`` / ``check_cp_length``: lengths; an impossible request raises
  ``CPLengthError`` naming the values and the nearest padded length.

``cp_chunk_bounds`` / ``cp_padded_length`` are the one definition of the chunking: the data
dispatcher (``megatron_earl.dispatch``) imports them from here. ``cp_chunk_bounds`` pads implicitly
(positions past ``seq_len`` are padding); the helpers here call ``check_cp_length`` first, because
a model batch must already be padded: an unpadded length is a user error, not padded silently.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = [
    "CPLengthError",
    "check_cp_length",
    "cp_chunk_bounds",
    "cp_padded_length",
    "cp_token_index",
    "merge_cp_shards",
    "packed_cp_token_index",
    "sequence_parallel_padding",
    "split_batch_for_cp",
]


def cp_padded_length(seq_len: int, cp: int) -> int:
    """Length of a sequence padded for CP: the smallest multiple of ``2 * cp`` >= ``seq_len``
    (unchanged when ``cp == 1``). The one definition of CP padding."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if seq_len < 0:
        raise ValueError(f"length must be >= 0, got {seq_len}")
    if cp == 1:
        return seq_len
    step = 2 * cp
    return -(-seq_len // step) * step


def sequence_parallel_padding(padded_lengths: Sequence[int], cp: int, sp: int) -> int:
    """Tokens to add to the last sequence of a packed micro-batch (already padded for CP:
    ``padded_lengths``) so that every CP rank's share splits evenly over ``sp`` sequence-parallel
    ranks (``sp`` = tp with sequence parallelism, else 1). The last sequence stays a multiple of
    ``2 * cp``; the answer is at most ``2 * cp * (sp - 1)`` tokens (``sp - 1`` at cp = 1).
    Example: ``sequence_parallel_padding([5, 6], cp=1, sp=4) == 1``;
    ``sequence_parallel_padding([4, 8], cp=2, sp=4) == 4`` (the shares grow from 6 to 8)."""
    if cp < 1 or sp < 1:
        raise ValueError(f"sequence_parallel_padding needs cp >= 1 and sp >= 1, got {cp}, {sp}")
    total = sum(padded_lengths)
    if total % cp:
        raise ValueError(f"packed length {total} is not a multiple of cp = {cp}: pad for CP first")
    step = 2 * cp if cp > 1 else 1  # what the last sequence may grow by, in global tokens
    share, share_step = total // cp, step // cp
    for k in range(sp):
        if (share + k * share_step) % sp == 0:
            return k * step
    raise AssertionError(f"no tail padding for share {share}, step {share_step}, sp {sp}")


def cp_chunk_bounds(seq_len: int, cp: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two half-open position ranges CP rank ``cp_rank`` holds of a ``seq_len``-token sequence.

    Positions are in the padded sequence (``cp_padded_length``); positions ``>= seq_len`` are
    padding. With chunk ``c = padded / (2 * cp)`` the ranges are ``[r*c, (r+1)*c)`` and
    ``[(2cp-1-r)*c, (2cp-r)*c)``; the rank's local sequence is their concatenation, ``padded / cp``
    tokens. Example: ``cp_chunk_bounds(10, 2, 0) == ((0, 3), (9, 12))`` (padded to 12, chunk 3).
    With ``cp == 1``: ``((0, seq_len), (seq_len, seq_len))``.
    """
    if cp < 1 or not 0 <= cp_rank < cp or seq_len < 0:
        raise ValueError(
            f"cp_chunk_bounds(seq_len={seq_len}, cp={cp}, cp_rank={cp_rank}): need "
            "seq_len >= 0, cp >= 1, 0 <= cp_rank < cp"
        )
    if cp == 1:
        return (0, seq_len), (seq_len, seq_len)
    c = cp_padded_length(seq_len, cp) // (2 * cp)
    late = 2 * cp - 1 - cp_rank
    return (cp_rank * c, (cp_rank + 1) * c), (late * c, (late + 1) * c)


class CPLengthError(ValueError):
    """A sequence length that cannot be split over the CP group; names every value involved."""


def check_cp_length(seq_len: int, cp: int, *, what: str = "sequence length") -> None:
    """Raise ``CPLengthError`` unless ``seq_len`` splits into ``2 * cp`` equal chunks (cp > 1)."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if cp > 1 and seq_len % (2 * cp):
        raise CPLengthError(
            f"{what} {seq_len} is not divisible by 2 x cp = {2 * cp} (cp = {cp}): context "
            f"parallelism splits each sequence into 2 x cp equal chunks; pad it to "
            f"{cp_padded_length(seq_len, cp)} (megatron_earl.parallel.cp.cp_padded_length) "
            f"or use a cp that divides {seq_len} / 2"
        )


def cp_token_index(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions (int64, local order) of the tokens CP rank ``cp_rank`` holds."""
    check_cp_length(seq_len, cp)
    return torch.cat([torch.arange(a, b) for a, b in cp_chunk_bounds(seq_len, cp, cp_rank)])


def packed_cp_token_index(
    cu_seqlens_padded: Sequence[int] | torch.Tensor, cp: int, cp_rank: int
) -> torch.Tensor:
    """Positions in a packed (thd) batch that CP rank ``cp_rank`` holds, sequence by sequence.

    ``cu_seqlens_padded`` are the global cumulative padded lengths; every sequence length must be a
    multiple of ``2 * cp``. Local sequence ``i`` then spans ``cu[i] // cp`` to ``cu[i + 1] // cp``.
    """
    # One device -> host read of the boundaries (not one per element).
    raw = (
        cu_seqlens_padded.tolist()
        if isinstance(cu_seqlens_padded, torch.Tensor)
        else cu_seqlens_padded
    )
    bounds = [int(x) for x in raw]
    pieces = []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        check_cp_length(end - start, cp, what=f"padded length of packed sequence {i}")
        pieces.append(start + cp_token_index(end - start, cp, cp_rank))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def split_batch_for_cp(
    batch: dict[str, object],
    cp: int,
    cp_rank: int,
    *,
    cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
    token_dim: int = 1,
) -> dict[str, object]:
    """This CP rank's share of a micro-batch: every tensor is indexed along ``token_dim``.

    Tensors whose ``token_dim`` is not the batch's token count (and non-tensors, such as
    ``packed_seq_params``) pass through unchanged. Without ``cu_seqlens_padded`` each row is one
    sequence (sbhd); with it the token dimension is a packed batch (thd). ``attention_mask``
    [b, 1, s, s] keeps all key columns and loses query rows, as in Megatron-LM.
    """
    if cp == 1:
        return dict(batch)
    tokens = batch["tokens"]
    assert isinstance(tokens, torch.Tensor)
    seq_len = tokens.size(token_dim)
    if cu_seqlens_padded is None:
        index = cp_token_index(seq_len, cp, cp_rank)
    else:
        total = int(cu_seqlens_padded[-1])
        if total != seq_len:
            raise CPLengthError(
                f"packed batch has {seq_len} tokens but cu_seqlens_padded ends at {total}"
            )
        index = packed_cp_token_index(cu_seqlens_padded, cp, cp_rank)
    index = index.to(tokens.device)  # built on the host from ints; follows the data
    out: dict[str, object] = {}
    for key, value in batch.items():
        if key == "attention_mask" and isinstance(value, torch.Tensor):
            out[key] = value.index_select(2, index)
        elif isinstance(value, torch.Tensor) and value.dim() > token_dim:
            same_len = value.size(token_dim) == seq_len
            out[key] = value.index_select(token_dim, index) if same_len else value
        else:
            out[key] = value
    return out


def merge_cp_shards(
    shards: Sequence[torch.Tensor],
    *,
    cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
    token_dim: int = 1,
) -> torch.Tensor:
    """Inverse of the split: the per-CP-rank tensors (index = CP rank) in global token order."""
    cp = len(shards)
    if cp == 1:
        return shards[0]
    local = shards[0].size(token_dim)
    total = local * cp
    index = [
        cp_token_index(total, cp, r)
        if cu_seqlens_padded is None
        else packed_cp_token_index(cu_seqlens_padded, cp, r)
        for r in range(cp)
    ]
    shape = list(shards[0].shape)
    shape[token_dim] = total
    out = shards[0].new_empty(shape)
    for idx, shard in zip(index, shards, strict=True):
        out.index_copy_(token_dim, idx.to(out.device), shard)
    return out
