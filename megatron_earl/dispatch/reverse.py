"""The reverse path: results computed in the destination layout go back to each sample's owner.

    local = execute(plan, batch)                  # destination micro-batches
    ... local.micro_batches[i].fields["new_logprobs"] = ...   (on the last pipeline stage)
    back = return_results(plan, local, ["new_logprobs"], ["values"])

Planned by ``plan.plan_return`` (every TP replica and every CP chunk holder of the holding stage is
a candidate source, CP padding is dropped) and run by the same executor as the forward path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from megatron_earl.dispatch.batch import Batch, FieldSpec, Schema
from megatron_earl.dispatch.execute import DispatchedBatch, _all_gather, _Store, run_stages
from megatron_earl.dispatch.plan import DispatchError, DispatchPlan, plan_return
from megatron_earl.dispatch.route import Piece


def return_results(
    plan: DispatchPlan,
    local: DispatchedBatch,
    token_fields: Sequence[str],
    sample_fields: Sequence[str] = (),
    stage: str = "last",
    transport: str = "p2p",
    group: dist.ProcessGroup | None = None,
) -> Batch:
    """Reverse path: send result fields of ``local`` (computed in the destination layout, present
    in every micro-batch of every rank of pipeline stage ``stage``) back to each sample's owner.

    ``token_fields`` are per-token (``[sum(local_lengths), ...]``, CP padding is dropped),
    ``sample_fields`` per-sample (``[num_samples, ...]``). Returns, on each rank, a ``Batch`` of the
    samples it owns (its first holder) in its original order, with only these fields.
    Which ranks call: every rank of ``group`` (one small all-gather, then the transfers)."""
    schema = _result_schema(plan, local, token_fields, sample_fields, stage, group)
    rplan = plan_return(plan, schema, stage)
    tensors = [t for mb in local.micro_batches for t in mb.fields.values()]
    store = _Store(tensors[0].device if tensors else None)
    me = dist.get_rank(group)
    if rplan.holdings.get(me):
        _store_local(local, schema, store)
    run_stages(rplan.stages, schema, store, transport, group)
    owned = [s for s in plan.source_order[me] if plan.samples[s].holders[0] == me]
    samples = []
    for sid in owned:
        whole = Piece(sid, 0, plan.samples[sid].length, ())
        row = Piece(sid, -1, -1, ())
        samples.append({s.name: store.get(whole if s.per_token else row, s.name) for s in schema})
    groups = [plan.samples[s].group for s in owned]
    return Batch.from_samples(samples, owned, schema, groups)


def _store_local(local: DispatchedBatch, schema: Schema, store: _Store) -> None:
    for mb in local.micro_batches:
        pos = 0
        for i, (sid, n, chunks) in enumerate(zip(mb.sample_ids, mb.lengths, mb.cp_bounds)):
            for a, b in chunks:
                real = min(b, n) - a
                for s in schema:
                    if s.per_token and real > 0:
                        piece = Piece(sid, a, a + real, ())
                        store.put(piece, s.name, mb.fields[s.name][pos : pos + real])
                pos += b - a
            for s in schema:
                if not s.per_token:
                    store.put(Piece(sid, -1, -1, ()), s.name, mb.fields[s.name][i])


def _result_schema(
    plan: DispatchPlan,
    local: DispatchedBatch,
    token_fields: Sequence[str],
    sample_fields: Sequence[str],
    stage: str,
    group: dist.ProcessGroup | None,
) -> Schema:
    """The result fields' specs, read where they are held and checked on all ranks together.

    Which ranks call: every rank of ``group`` (one all-gather carrying specs and problems)."""
    layout = plan.destination.layout
    holds = layout.coord(dist.get_rank(group)).pp == (0 if stage == "first" else layout.pp - 1)
    specs: set[FieldSpec] = set()
    problems = []
    if holds:
        for mb in local.micro_batches:
            for names, per_token, rows in (
                (token_fields, True, sum(mb.local_lengths)),
                (sample_fields, False, len(mb.sample_ids)),
            ):
                for f in names:
                    t = mb.fields.get(f)
                    if t is None or t.dim() < 1 or t.shape[0] != rows:
                        shape = None if t is None else tuple(t.shape)
                        problems.append(f"field {f!r} shape {shape}, expected dim 0 = {rows}")
                    else:
                        specs.add(FieldSpec(f, t.dtype, per_token, tuple(t.shape[1:])))
    gathered = _all_gather((specs, problems[:3]), group)
    bad = {r: p for r, (_, p) in enumerate(gathered) if p}
    if bad:
        raise DispatchError(f"return_results: bad result tensors on ranks {bad}")
    union = set().union(*(s for s, _ in gathered))
    names = [s.name for s in union]
    if len(names) != len(set(names)):
        raise DispatchError(
            f"return_results: ranks disagree on dtype/shape of {sorted(union, key=str)}; every "
            "holding rank must produce one dtype and trailing shape per field"
        )
    return tuple(sorted(union, key=lambda s: s.name))
