"""The centralized (single-controller) baseline, expressed as a plan over the same needs.

What single-controller RL systems do with every intermediate batch: gather all of it to one
process (here rank ``root``), then send each worker its part. ``centralized_stages(plan)`` builds
exactly that for the same destination needs as the decentralized ``plan``, so the executor, the
result and the byte accounting are shared and the comparison isolates the routing. The baseline is
generous: the root forwards only the slices each rank needs (no padding, only its stage's fields),
which real drivers usually do not. Used only by tests and the benchmark.
"""

from __future__ import annotations

from collections import defaultdict

from megatron_earl.config.vocab import Fanout
from megatron_earl.dispatch.plan import DispatchPlan, rank_needs
from megatron_earl.dispatch.route import Piece, RouteConfig, Transfer, route


def centralized_stages(plan: DispatchPlan, root: int = 0) -> list[list[Transfer]]:
    """Gather stage: every sample (all fields, from one holder) to ``root``; scatter stage:
    ``root`` sends each rank each of its needed pieces directly (no relay). Always two stages.

    For a rank view (``plan.rank``), the transfers that rank takes part in: the root works out
    every rank's needs (the controller's own planning, O(ranks x pieces)); another rank routes
    only the samples it holds and its own needs."""
    token = tuple(s.name for s in plan.schema if s.per_token)
    per_sample = tuple(s.name for s in plan.schema if not s.per_token)
    samples, me = plan.samples, plan.rank
    everything = me is None or me == root

    def pieces(sid: int) -> list[Piece]:
        out = [Piece(sid, 0, samples[sid].length, token)] if token else []
        return out + ([Piece(sid, -1, -1, per_sample)] if per_sample else [])

    gathered = list(samples) if everything else sorted(plan.source_order[me])
    holdings: dict[int, list[Piece]] = defaultdict(list)
    for sid in gathered:
        for r in samples[sid].holders:
            holdings[r] += pieces(sid)
    if me is None:
        needs = plan.needs
    elif me == root:
        layout, lengths = plan.destination.layout, dict(zip(samples.ids, samples.lengths))
        needs = {
            r: rank_needs(
                plan.destination, plan.schema, r, [plan.assignment[layout.coord(r).dp]], lengths
            )
            for r in range(layout.world_size)
        }
    else:
        needs = {me: plan.needs[me]}
    scattered = list(samples) if everything else sorted({p.sample_id for p in needs[me]})
    direct = RouteConfig(fanout=Fanout.DIRECT)
    want = [p for sid in gathered for p in pieces(sid)]
    gather = route(dict(holdings), {root: want}, plan.schema, direct)
    have = [p for sid in scattered for p in pieces(sid)]
    scatter = route({root: have}, needs, plan.schema, direct)
    stages = [gather[0] if gather else [], scatter[0] if scatter else []]
    if everything:
        return stages
    return [[t for t in s if me in (t.src, t.dst)] for s in stages]
