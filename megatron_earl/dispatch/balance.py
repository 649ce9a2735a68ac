"""Balanced assignment of samples to data-parallel ranks (pure).

Greedy largest-first (LPT) on a per-sample cost, then local search: move one unit, or swap two,
between the heaviest and the lightest rank while that lowers the maximum. A unit is a sample, or a
whole group (the samples of one prompt) with ``keep_groups``. On long-tailed agentic lengths this
keeps max/mean tokens per DP rank within a few percent (tests/unit/test_dispatch_plan.py).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from megatron_earl.dispatch.route import DispatchError

if TYPE_CHECKING:
    from megatron_earl.dispatch.plan import PlanConfig


def assign_samples(
    lengths: dict[int, int], groups: dict[int, int], dp: int, config: PlanConfig
) -> list[list[int]]:
    """Sample ids per DP rank, balanced by ``config.cost`` (greedy largest-first, then moves/swaps
    between the heaviest and the lightest rank while that lowers the maximum)."""
    units: dict[int, list[int]] = {}
    for sid in sorted(lengths):
        units.setdefault(groups[sid] if config.keep_groups else sid, []).append(sid)
    what = "groups" if config.keep_groups else "samples"
    if len(units) < dp:
        raise DispatchError(
            f"{len(units)} {what} cannot fill dp={dp} ranks (every DP rank needs at least one); "
            f"dispatch at least {dp} {what} or use a layout with dp <= {len(units)}"
        )
    cost = {u: sum(config.cost(lengths[s]) for s in sids) for u, sids in units.items()}
    order = sorted(units, key=lambda u: (-cost[u], u))
    heap = [(0.0, r) for r in range(dp)]
    bins: list[list[int]] = [[] for _ in range(dp)]
    for u in order:
        load, r = heapq.heappop(heap)
        bins[r].append(u)
        heapq.heappush(heap, (load + cost[u], r))
    _refine(bins, cost)
    return [sorted(s for u in b for s in units[u]) for b in bins]


def _refine(bins: list[list[int]], cost: dict[int, float], max_rounds: int = 200) -> None:
    loads = [sum(cost[u] for u in b) for b in bins]
    for _ in range(max_rounds):
        hi = max(range(len(bins)), key=lambda r: (loads[r], -r))
        lo = min(range(len(bins)), key=lambda r: (loads[r], r))
        gap = loads[hi] - loads[lo]
        best, best_delta = None, 0.0
        for u in bins[hi]:
            # a move (v=None) or a swap that shifts delta = cost[u] - cost[v] from hi to lo
            for v in [None, *bins[lo]]:
                delta = cost[u] - (cost[v] if v is not None else 0.0)
                if 0 < delta < gap and abs(gap - 2 * delta) < abs(gap - 2 * best_delta):
                    best, best_delta = (u, v), delta
        if best is None or max(loads[hi] - best_delta, loads[lo] + best_delta) >= loads[hi]:
            return
        u, v = best
        bins[hi].remove(u)
        bins[lo].append(u)
        if v is not None:
            bins[lo].remove(v)
            bins[hi].append(v)
        loads[hi] -= best_delta
        loads[lo] += best_delta
