"""One step of the embedded engine's forward, as the host describes it: the sequences and their
cache rows (``Batch``) and a prefill step's index tensors (``StepIndex``), computed with numpy from
Python ints and moved to the compute device once (boundary "engine step inputs", docs/devices.md);
and the ``Step`` the engine's scheduler broadcasts for every rank of its TP group to execute.

    batch = Batch(rows=(3, 4), tokens=((5, 9, 2), (7, 1)), starts=(0, 2))
    index = StepIndex.build(batch)          # host tensors, one per index (StepTensors)
    step = index.on_device()                # what batched_forward.py's _prefill reads

Pure host code: no collective, no model. Legend as in ``rollout/embedded/batched_forward.py``
(T = new tokens of the step, k = sequences, R = tokens whose logits are returned, W = cache
writes).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from megatron_earl import runtime
from megatron_earl.config.vocab import MemoryTag


@dataclass(frozen=True)
class Batch:
    """One step's sequences, each in its cache row with new tokens after what the row caches."""

    rows: tuple[int, ...]
    """Cache row of each sequence (a decode step: exactly ``0 .. n-1``)."""
    tokens: tuple[tuple[int, ...], ...]
    """New token ids per sequence (decode: one each; prefill: the uncached rest of the context)."""
    starts: tuple[int, ...]
    """Tokens the row already caches (the position of the sequence's first new token)."""
    shared: tuple[tuple[int, ...], ...] = ()
    """Per sequence, further rows that receive the same keys and values (requests with the
    identical context: a GRPO group's prompt is prefilled once); empty = none."""
    logits_from: tuple[int, ...] = ()
    """Per sequence, the index (within its new tokens) of the first token whose logits are
    returned, up to its last (prompt log-probs); empty = the last token of each only."""

    def __post_init__(self) -> None:
        k = len(self.tokens)
        if not k or len(self.rows) != k or len(self.starts) != k:
            raise ValueError(
                f"a step needs >= 1 sequence and one row and start per sequence, got {k} token "
                f"lists, {len(self.rows)} rows and {len(self.starts)} starts"
            )
        if self.shared and len(self.shared) != k:
            raise ValueError(f"shared needs one entry per sequence ({k}), got {len(self.shared)}")
        if any(not t for t in self.tokens):
            raise ValueError("every sequence of a step needs at least one new token")
        if self.logits_from and (
            len(self.logits_from) != k
            or not all(0 <= f < len(t) for f, t in zip(self.logits_from, self.tokens))
        ):
            raise ValueError(
                f"logits_from needs one index per sequence within its new tokens, got "
                f"{self.logits_from} for {[len(t) for t in self.tokens]} new tokens"
            )

    @classmethod
    def decode(cls, lengths: Sequence[int], tokens: Sequence[int]) -> Batch:
        return cls(tuple(range(len(tokens))), tuple((int(t),) for t in tokens), tuple(lengths))

    @functools.cached_property
    def is_decode(self) -> bool:
        """One new token per row, rows ``0 .. n-1`` in order (a decode step; the forward reads
        the cache as a view). A prefill of one-token contexts is not one."""
        return (
            all(len(t) == 1 for t in self.tokens)
            and not any(self.shared)
            and not self.logits_from
            and self.rows == tuple(range(len(self.rows)))
        )


class StepTensors(NamedTuple):
    """A prefill step's index tensors (long, one dimension each)."""

    ids: torch.Tensor
    """Per new token [T]: its id."""
    pos: torch.Tensor
    """[T]: its position."""
    seq: torch.Tensor
    """[T]: its sequence."""
    local: torch.Tensor
    """[T]: its index among its sequence's new tokens."""
    last: torch.Tensor
    """[R]: the tokens whose logits are returned."""
    start: torch.Tensor
    """Per sequence [k]: the position of its first new token (what its row caches)."""
    rows: torch.Tensor
    """[k]: its cache row."""
    w_rows: torch.Tensor
    """Per cache write [W]: the row written."""
    w_pos: torch.Tensor
    """[W]: the position written."""
    w_src: torch.Tensor
    """[W]: the new token whose key and value are written."""
    width: torch.Tensor
    """``arange`` of the most new tokens of a sequence."""
    slot: torch.Tensor
    """Per padded query slot ``[k * width]`` (sequence after sequence): the new token it holds,
    the sequence's last where the slot is past its end (padding)."""
    key_pos: torch.Tensor
    """``arange`` of the longest sequence's keys (cached and new)."""


@dataclass(frozen=True)
class StepIndex:
    """Host index tensors of a step (built once from Python ints)."""

    tensors: StepTensors
    fresh: bool
    """No sequence has a cached prefix (every start is 0)."""
    max_new: int
    """The most new tokens of a sequence (the padded query width)."""
    max_key_len: int
    """The longest sequence's keys, cached and new."""
    shared: bool = False
    """Some sequence's keys/values also go to other rows (the writes gather by source token)."""

    @property
    def num_seqs(self) -> int:
        return self.tensors.rows.numel()

    @property
    def num_returned(self) -> int:
        """Tokens whose logits the step returns (R)."""
        return self.tensors.last.numel()

    @classmethod
    def build(cls, batch: Batch) -> StepIndex:
        """The index tensors, computed with numpy over the sequences, not a Python loop over
        every token (docs/measurements/engine.md)."""
        lengths = [len(t) for t in batch.tokens]
        n_k, start_k = np.array(lengths), np.array(batch.starts)
        seq, local, first_k = _spans(n_k)
        if batch.logits_from:
            last = np.flatnonzero(local >= np.array(batch.logits_from)[seq])
        else:
            last = first_k + n_k - 1
        # Writes: each sequence's tokens to its row, then to each row it shares them with.
        shared = batch.shared or ((),) * len(lengths)
        targets = [
            (s, r) for s, (row, more) in enumerate(zip(batch.rows, shared)) for r in (row, *more)
        ]
        target_seq, target_row = np.array(targets).T
        w_target, w_local, _ = _spans(n_k[target_seq])
        w_seq = target_seq[w_target]
        max_key_len = max(start + n for start, n in zip(batch.starts, lengths))
        width = np.arange(max(lengths))
        slot = first_k[:, None] + np.minimum(width[None, :], n_k[:, None] - 1)
        ids = np.fromiter(itertools.chain.from_iterable(batch.tokens), np.int64, len(seq))
        tensors = StepTensors(
            *(
                torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
                for a in (
                    ids,
                    start_k[seq] + local,
                    seq,
                    local,
                    last,
                    start_k,
                    np.array(batch.rows),
                    target_row[w_target],
                    start_k[w_seq] + w_local,
                    first_k[w_seq] + w_local,
                    width,
                    slot.reshape(-1),
                    np.arange(max_key_len),
                )
            )
        )
        return cls(
            tensors,
            fresh=not any(batch.starts),
            max_new=max(lengths),
            max_key_len=max_key_len,
            shared=any(batch.shared),
        )

    def on_device(self) -> StepTensors:
        """The index tensors on the compute device (boundary "engine step inputs")."""
        return StepTensors(*(runtime.to_device(t) for t in self.tensors))


@dataclass(frozen=True)
class Step:
    """One unit of work every rank of the TP group executes identically."""

    kind: str
    """"forward", "load", "release", "resume", "call" or "stop"."""
    batch: Batch | None = None
    """Forward: the sequences and their new tokens (a prefill or a decode)."""
    moves: tuple[tuple[int, int, int], ...] = ()
    """Row copies (src, dst, length) applied first: finished rows refilled by the last row."""
    state: dict[str, torch.Tensor] | None = None
    """Load: full (global) tensors keyed like ``geometry.full_state_dict``."""
    tags: tuple[MemoryTag, ...] = ()
    """Release / resume: the memory tags."""
    fn: Callable[[Any], Any] | None = None
    """Call: run on every rank with that rank's ``EmbeddedEngine`` (picklable: a module-level
    function or a ``functools.partial`` of one); None is a no-op (the idle ping)."""


def _spans(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Items laid out as consecutive spans of ``counts[i]`` items: each item's span, each item's
    index within its span, and each span's first item."""
    first = np.cumsum(counts) - counts
    span = np.repeat(np.arange(counts.size), counts)
    return span, np.arange(span.size) - first[span], first
