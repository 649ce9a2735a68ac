"""The centralized (single-controller) baseline, expressed as a plan over the same needs.

What single-controller RL systems do with every intermediate batch: gather all of it to one
process (here rank ``root``), then send each worker its part. ``centralized_stages(plan)`` builds
exactly that for the same destination needs as the decentralized ``plan``, so the executor, the
result and the byte accounting are shared and the comparison isolates the routing. The baseline is
generous: the root forwards only the slices each rank needs (no padding, only its stage's fields),
which real drivers usually do not. Used only by tests and the benchmark.
"""

from __future__ import annotations

from megatron_earl.dispatch.plan import Plan
from megatron_earl.dispatch.route import Piece, RouteConfig, Transfer, route


def centralized_stages(plan: Plan, root: int = 0) -> list[list[Transfer]]:
    """Gather stage(s): every sample (all fields, from one holder) to ``root``; scatter stage:
    ``root`` sends each rank each of its needed pieces directly (no relay)."""
    token = tuple(s.name for s in plan.schema if s.per_token)
    per_sample = tuple(s.name for s in plan.schema if not s.per_token)
    lengths: dict[int, int] = {}
    for pieces in plan.holdings.values():
        for p in pieces:
            lengths[p.sample_id] = max(lengths.get(p.sample_id, 0), p.end)
    full: list[Piece] = []
    for sid in sorted(lengths):
        full += [Piece(sid, 0, lengths[sid], token)] if token else []
        full += [Piece(sid, -1, -1, per_sample)] if per_sample else []
    direct = RouteConfig(fanout="direct")
    gather = route(plan.holdings, {root: full}, plan.schema, direct)
    scatter = route({root: full}, plan.needs, plan.schema, direct)
    return [*gather, *scatter]
