"""The sample table of a dispatch (pure): every sample's length, group and holders, collected
from every rank's ``SourceMeta`` into numpy arrays (``collect``), with the checks that replicas
agree and lengths are positive. ``plan.plan_dispatch`` builds it first, on every rank alike."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron_earl.dispatch.route import DispatchError

if TYPE_CHECKING:
    from megatron_earl.dispatch.spec import SourceMeta


@dataclass(frozen=True)
class SampleInfo:
    """A sample as the planner sees it."""

    length: int
    group: int
    holders: tuple[int, ...]
    """Source ranks holding it; ``holders[0]`` is its owner (where results return)."""


class SampleTable(Mapping):
    """Every sample of a dispatch, ascending ids -> ``SampleInfo`` (built on lookup: the table
    itself is a few numpy arrays, so collecting tens of thousands of samples costs little).

    Row ``i`` is the ``i``-th smallest id; ``holder_ranks[starts[i]:starts[i + 1]]`` are its
    holders in rank order (the first is its owner)."""

    def __init__(
        self,
        ids: np.ndarray,
        lengths: np.ndarray,
        groups: np.ndarray,
        holder_ranks: np.ndarray,
        starts: np.ndarray,
    ) -> None:
        self.id_array, self.length_array, self.group_array = ids, lengths, groups
        self.holder_ranks, self.starts = holder_ranks, starts
        self.owners = holder_ranks[starts[:-1]]
        """Each row's owner (first holder)."""
        self.num_holders = np.diff(starts)
        """Each row's number of holders."""
        n = len(ids)
        self._dense = bool(n and ids[0] == 0 and ids[-1] == n - 1)  # ids 0..n-1: row = id
        self._single = bool((self.num_holders == 1).all())  # no replicas

    @functools.cached_property
    def ids(self) -> list[int]:
        """Sample ids in row order (ascending)."""
        return self.id_array.tolist()

    @functools.cached_property
    def lengths(self) -> list[int]:
        """Tokens of each sample, in row order."""
        return self.length_array.tolist()

    def rows(self, sample_ids: Sequence[int]) -> np.ndarray:
        """Rows of ``sample_ids`` (all present)."""
        return np.searchsorted(self.id_array, np.asarray(sample_ids, dtype=np.int64))

    def row(self, sample_id: int) -> int:
        """The row of ``sample_id`` (O(1) for ids 0..n-1); ``KeyError`` when absent."""
        if self._dense:
            if 0 <= sample_id < len(self.id_array):
                return int(sample_id)
            raise KeyError(sample_id)
        i = int(self.id_array.searchsorted(sample_id))
        if i == len(self.id_array) or self.id_array[i] != sample_id:
            raise KeyError(sample_id)
        return i

    def holders(self, row: int) -> tuple[int, ...]:
        """The ranks holding a copy of ``row``'s sample, ascending."""
        if self._single:
            return (int(self.owners[row]),)
        return tuple(self.holder_ranks[self.starts[row] : self.starts[row + 1]].tolist())

    def __getitem__(self, sample_id: int) -> SampleInfo:
        i = self.row(sample_id)
        return SampleInfo(int(self.length_array[i]), int(self.group_array[i]), self.holders(i))

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.id_array)

    def length(self, sample_id: int) -> int:
        """Tokens of ``sample_id``."""
        return int(self.length_array[self.row(sample_id)])


def collect(sources: Sequence[SourceMeta]) -> SampleTable:
    """Every sample with its holders (vectorised); raises for inconsistent metadata."""
    columns = (
        [s.sample_ids for s in sources],
        [s.lengths for s in sources],
        [s.group_ids for s in sources],
    )
    counts = [len(c) for c in columns[0]]
    if [len(c) for c in columns[1]] != counts or [len(c) for c in columns[2]] != counts:
        r, src = next(
            (r, s)
            for r, s in enumerate(sources)
            if not len(s.sample_ids) == len(s.lengths) == len(s.group_ids)
        )
        raise DispatchError(
            f"rank {r}: {len(src.sample_ids)} sample_ids, {len(src.lengths)} lengths, "
            f"{len(src.group_ids)} group_ids; give one of each per sample"
        )
    total = sum(counts)
    ids, lens, groups = (
        np.fromiter(itertools.chain.from_iterable(c), dtype=np.int64, count=total) for c in columns
    )
    ranks = np.repeat(np.arange(len(sources), dtype=np.int64), counts)
    order = np.argsort(ids, kind="stable")  # replicas of a sample stay in rank order
    ids, lens, groups, ranks = ids[order], lens[order], groups[order], ranks[order]
    first = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if total else order
    run = np.repeat(first, np.diff(np.r_[first, total]))  # index of each entry's first copy
    bad = np.flatnonzero((lens != lens[run]) | (groups != groups[run]))
    if len(bad):
        i = int(bad[0])
        j = int(run[i])
        agree = [int(r) for r in ranks[j:i]]
        raise DispatchError(
            f"sample {ids[i]} is held by ranks {agree} with (length, group) = "
            f"({lens[j]}, {groups[j]}) and by rank {ranks[i]} with ({lens[i]}, {groups[i]}); "
            "replicas must agree (or give the samples distinct ids)"
        )
    short = np.flatnonzero(lens < 1)
    if len(short):
        i = int(short[0])
        raise DispatchError(f"sample {ids[i]} on rank {ranks[i]} has length {lens[i]}; need >= 1")
    starts = np.r_[first, total].astype(np.int64)
    return SampleTable(ids[first], lens[first], groups[first], ranks, starts)
