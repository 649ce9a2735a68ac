"""Balanced assignment of samples to data-parallel ranks (pure).

Greedy largest-first (LPT) on a per-sample cost, then local search: move one unit, or swap two,
between the heaviest and the lightest rank while that lowers the maximum. A unit is a sample, or a
whole group (the samples of one prompt) with ``keep_groups`` (or ``prefer_groups`` when there
are at least ``PREFER_GROUPS_PER_RANK`` groups per DP rank). On long-tailed agentic lengths this
keeps max/mean tokens per DP rank within a few percent (tests/unit/test_dispatch_plan.py).

``balance`` works on numpy arrays of the samples (what the planner holds), ``assign_samples`` on
dicts; ``BalanceMemo`` reuses a balance for identical inputs (plans of one batch to destinations
of the same dp).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from megatron_earl.dispatch.route import DispatchError

if TYPE_CHECKING:
    from megatron_earl.dispatch.spec import PlanConfig

REFINE_TOLERANCE = 1e-4
"""Local search stops once the heaviest DP rank is within this fraction of the mean cost."""
LPT_UNITS_PER_RANK = 8
"""Units per DP rank placed one by one (largest first onto the lightest rank); the smaller rest
is placed a round of ``dp`` at a time (numpy), then the local search evens it out."""
ROUNDS_MIN_DP = 16
"""Below this many DP ranks every unit is placed one by one (a numpy round costs more than
``dp`` heap steps)."""


PREFER_GROUPS_PER_RANK = 2
"""``prefer_groups`` balances by groups only with at least this many groups per DP rank (with
fewer, whole groups leave the balance little freedom; it balances samples)."""


def assign_samples(
    lengths: dict[int, int], groups: dict[int, int], dp: int, config: PlanConfig
) -> list[list[int]]:
    """Sample ids per DP rank (each ascending), balanced by ``config.cost`` (``balance``)."""
    ids = np.fromiter(lengths, dtype=np.int64, count=len(lengths))
    lens = np.fromiter(lengths.values(), dtype=np.int64, count=len(lengths))
    grps = (
        np.fromiter((groups[s] for s in lengths), dtype=np.int64, count=len(lengths))
        if config.keep_groups or config.prefer_groups
        else ids
    )
    order = np.argsort(ids, kind="stable")
    ids, lens, grps = ids[order], lens[order], grps[order]
    return split_by_owner(ids, balance(ids, lens, grps, dp, config), dp)


def split_by_owner(ids: np.ndarray, owner: np.ndarray, dp: int) -> list[list[int]]:
    """``ids`` (ascending) per DP rank, from each sample's DP rank ``owner``."""
    key = owner.astype(np.uint16) if dp <= 1 << 16 else owner  # 16 bits: a radix sort
    order = key.argsort(kind="stable")  # within a rank, ids stay ascending
    cuts = np.cumsum(np.bincount(owner, minlength=dp))[:-1]
    return [part.tolist() for part in np.split(ids[order], cuts)]


def balance(
    ids: np.ndarray, lengths: np.ndarray, groups: np.ndarray, dp: int, config: PlanConfig
) -> np.ndarray:
    """The DP rank of every sample (``ids`` ascending, with their ``lengths`` and ``groups``),
    balanced by ``config.cost``: greedy largest-first (the largest ``LPT_UNITS_PER_RANK * dp``
    units one by one, the rest in rounds of ``dp`` when ``dp >= ROUNDS_MIN_DP``), then moves/swaps
    between the heaviest and the lightest rank while that lowers the maximum (``_refine``)."""
    sample_cost = config.cost(lengths.astype(np.float64))
    by_group = config.keep_groups or (
        config.prefer_groups and np.unique(groups).size >= PREFER_GROUPS_PER_RANK * dp
    )
    if by_group:  # a unit is a group; its cost sums its samples' in id order
        unit_ids, unit_of = np.unique(groups, return_inverse=True)
        costs = np.bincount(unit_of, weights=sample_cost, minlength=len(unit_ids))
    else:  # every sample is a unit
        unit_ids, unit_of, costs = ids, None, sample_cost
    what = "groups" if by_group else "samples"
    if len(unit_ids) < dp:
        raise DispatchError(
            f"{len(unit_ids)} {what} cannot fill dp={dp} ranks (every DP rank needs at least "
            f"one); dispatch at least {dp} {what} or use a layout with dp <= {len(unit_ids)}"
        )
    by_cost = _descending(costs, None if by_group else lengths)
    ordered = costs[by_cost]
    owner = np.empty(len(ordered), dtype=np.int64)  # DP rank per unit, in by_cost order
    head = len(ordered) if dp < ROUNDS_MIN_DP else min(len(ordered), LPT_UNITS_PER_RANK * dp)
    heap = [(0.0, r) for r in range(dp)]
    placed: list[int] = []
    place, replace = placed.append, heapq.heapreplace  # local names: the loop's bulk
    for c in ordered[:head].tolist():  # exact largest-first for the large units
        load, r = heap[0]
        place(r)
        replace(heap, (load + c, r))
    owner[:head] = placed
    if head < len(ordered):  # the small rest in rounds: a round's largest to the lightest rank
        loads = np.zeros(dp)
        for load, r in heap:
            loads[r] = load
        full = (len(ordered) - head) // dp  # whole rounds, then a partial one
        owners = owner[head : head + full * dp].reshape(full, dp)  # views: rows are rounds
        parts = ordered[head : head + full * dp].reshape(full, dp)
        for j in range(full):
            ranks = loads.argsort(kind="stable")
            owners[j] = ranks
            loads[ranks] += parts[j]
        if head + full * dp < len(ordered):
            part = ordered[head + full * dp :]
            owner[head + full * dp :] = loads.argsort(kind="stable")[: len(part)]
    _refine(owner, ordered, dp)
    unit_owner = np.empty_like(owner)
    unit_owner[by_cost] = owner
    return unit_owner if unit_of is None else unit_owner[unit_of]


class BalanceMemo:
    """Balances (``balance``'s DP rank of every sample) by their exact inputs, so the plans of
    one batch to destinations of the same dp (e.g. the experience and train phases of a step, to
    different layouts or fields) balance it once. The key is the samples' ids and lengths (and
    groups with ``keep_groups`` or ``prefer_groups``) as bytes, dp and the cost settings: a
    balance is never reused for inputs that differ in any of them. Least recently used balances
    are dropped beyond ``size``."""

    def __init__(self, size: int = 8) -> None:
        if size < 1:
            raise DispatchError(f"BalanceMemo size={size}; use >= 1")
        self.size = size
        self.owners: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self.hits = 0
        """Balances served from the memo."""
        self.misses = 0
        """Balances computed."""

    def balance(
        self, ids: np.ndarray, lengths: np.ndarray, groups: np.ndarray, dp: int, config: PlanConfig
    ) -> np.ndarray:
        """``balance(ids, lengths, groups, dp, config)``, read-only, from the memo when its
        inputs repeat."""
        key = (
            ids.tobytes(),
            lengths.tobytes(),
            groups.tobytes() if config.keep_groups or config.prefer_groups else b"",
            dp,
            config.attention_weight,
            config.keep_groups,
            config.prefer_groups,
        )
        if key in self.owners:
            self.hits += 1
            self.owners.move_to_end(key)
            return self.owners[key]
        self.misses += 1
        owner = balance(ids, lengths, groups, dp, config)
        owner.flags.writeable = False  # shared by the plans that reuse it
        self.owners[key] = owner
        while len(self.owners) > self.size:
            self.owners.popitem(last=False)
        return owner


def _descending(costs: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """Positions of units (ascending ids) by cost descending, ties by id. A sample's cost grows
    with its length, and below 2**52 two costs of different lengths differ by >= 1 even rounded,
    so sorting the ``lengths`` of samples gives that order (a radix sort when they fit 16 bits)."""
    if lengths is None or not len(costs) or costs.max() >= 2.0**52:
        return np.lexsort((np.arange(len(costs)), -costs))
    top = int(lengths.max())
    key = (top - lengths).astype(np.uint16) if top < 1 << 16 else -lengths
    return np.argsort(key, kind="stable")


def _refine(owner: np.ndarray, costs: np.ndarray, dp: int, max_rounds: int = 200) -> None:
    """Moves/swaps between the heaviest and the lightest rank while that lowers the maximum
    (``owner``: the rank of each unit of ``costs``, updated in place); each round scores every
    (move, swap) pair at once (numpy) and takes the first best in scan order (units of the
    heaviest rank, then "move" before swaps with the lightest rank's units). A rank's units are
    in placement order (``costs``' order, a unit moved in goes last). Stops once the heaviest
    rank is within ``REFINE_TOLERANCE`` of the mean (nothing left to gain)."""
    loads = np.bincount(owner, weights=costs, minlength=dp).tolist()  # sums in placement order
    mean = sum(loads) / dp
    bins: dict[int, list[int]] = {}  # unit positions of the ranks touched so far, in order

    def units(r: int) -> list[int]:
        if r not in bins:
            bins[r] = np.flatnonzero(owner == r).tolist()
        return bins[r]

    for _ in range(max_rounds):
        hi = max(range(dp), key=lambda r: (loads[r], -r))
        lo = min(range(dp), key=lambda r: (loads[r], r))
        gap = loads[hi] - loads[lo]
        if loads[hi] <= mean * (1 + REFINE_TOLERANCE) or not units(hi):
            return
        cu = costs[units(hi)]
        cv = np.concatenate(([0.0], costs[units(lo)]))  # 0.0: a move (no unit back)
        delta = cu[:, None] - cv[None, :]
        score = np.where((delta > 0) & (delta < gap), np.abs(gap - 2 * delta), np.inf)
        i, j = np.unravel_index(int(np.argmin(score)), score.shape)
        if not np.isfinite(score[i, j]):
            return
        best_delta = float(delta[i, j])
        if max(loads[hi] - best_delta, loads[lo] + best_delta) >= loads[hi]:
            return
        u = bins[hi].pop(i)
        bins[lo].append(u)
        owner[u] = lo
        if j > 0:
            v = bins[lo].pop(j - 1)
            bins[hi].append(v)
            owner[v] = hi
        loads[hi] -= best_delta
        loads[lo] += best_delta
