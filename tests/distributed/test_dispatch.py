"""The dispatcher on 4 real gloo processes: every destination rank ends with exactly the naive
reference's slices (bitwise), for p2p, all_to_all and the centralized baseline; the reverse path
restores each owner's original samples bitwise; bad input raises the same error on every rank
before any data moves (no hang: every run has a timeout)."""

from __future__ import annotations

import torch.distributed as dist

from megatron_earl.dispatch.batch import Batch, FieldSpec, tensors_equal
from megatron_earl.dispatch.execute import execute, plan_for
from megatron_earl.dispatch.reference import (
    agentic_lengths,
    agentic_schema,
    expected_local,
    make_batches,
)
from megatron_earl.dispatch.reverse import return_results
from megatron_earl.dispatch.route import DispatchError, RouteConfig
from megatron_earl.dispatch.spec import Destination, PlanConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed

WORLD = 4
CASES = [
    # (destination layout, per-rank token budget, fanout, keep_groups)
    ("tp2cp1pp1dp2", None, "node_relay", False),
    ("tp1cp2pp1dp2", 1024, "direct", True),
    ("tp1cp1pp2dp2", 2048, "node_relay", False),
    ("tp2cp2pp1dp1", None, "node_relay", True),
]


def _body_roundtrip() -> list[str]:
    rank = dist.get_rank()
    schema = agentic_schema()
    lengths = agentic_lengths(20, max_len=2048, seed=7, min_len=1)
    # rank 3 produced nothing; sample 0 is replicated on ranks 0 and 1
    owners = [[0, *range(1, 20, 3)], [0, *range(2, 20, 3)], list(range(3, 20, 3)), []]
    samples, batches = make_batches(schema, lengths, owners, seed=11, group_size=4)
    batch = batches[rank]
    done = []
    for text, budget, fanout, keep in CASES:
        cfg = PlanConfig(
            max_tokens_per_micro_batch=budget,
            keep_groups=keep,
            route=RouteConfig(fanout=fanout, ranks_per_node=2),
        )
        plan = plan_for(batch, Destination(ParallelLayout.parse(text)), cfg)
        want = expected_local(plan, samples, rank)
        runs = {
            "p2p": execute(plan, batch),
            "all_to_all": execute(plan, batch, transport="all_to_all"),
            "centralized": execute(plan, batch, centralized=True),
        }
        for name, local in runs.items():
            assert len(local.micro_batches) == len(want), (text, name)
            for exp, got in zip(want, local.micro_batches):
                assert exp.keys() == got.fields.keys(), (text, name)
                for k in exp:
                    assert tensors_equal(exp[k], got.fields[k]), (text, name, k)
        # reverse path: send every field back from the last stage
        token = [s.name for s in schema if s.per_token]
        per_sample = [s.name for s in schema if not s.per_token]
        back = return_results(plan, runs["p2p"], token, per_sample)
        owned = [s for s in batch.sample_ids if plan.samples[s].holders[0] == rank]
        assert back.sample_ids == owned, (text, back.sample_ids, owned)
        for sid in owned:
            got, orig = back.sample(sid), batch.sample(sid)
            assert all(tensors_equal(got[k], orig[k]) for k in orig), (text, sid)
        done.append(text)
    return done


def test_dispatch_matches_reference_and_round_trips():
    results = run_distributed(_body_roundtrip, WORLD, timeout_s=180)
    assert results == [[c[0] for c in CASES]] * WORLD


def _catch(fn) -> str:
    try:
        fn()
    except DispatchError as err:
        return str(err)
    return "no error"


def _body_bad_input() -> dict[str, str]:
    rank = dist.get_rank()
    schema = agentic_schema()
    lengths = [100, 3000, 50, 70, 80]
    owners = [[0, 1], [2], [3, 4], []]
    _, batches = make_batches(schema, lengths, owners, group_size=2)
    batch = batches[rank]
    dest = Destination(ParallelLayout(tp=2, dp=2))
    out = {}
    out["budget"] = _catch(
        lambda: plan_for(batch, dest, PlanConfig(max_tokens_per_micro_batch=2048))
    )
    keep = PlanConfig(keep_groups=True)
    out["empty_dp"] = _catch(lambda: plan_for(batch, Destination(ParallelLayout(dp=4)), keep))
    # rank 1 disagrees on the schema (an extra field)
    if rank == 1:
        extra = (*schema, FieldSpec("zz_extra", batch.token_fields["tokens"].dtype, True))
        fields = {**batch.token_fields, "zz_extra": batch.token_fields["tokens"]}
        batch = Batch(batch.sample_ids, batch.lengths, fields, batch.sample_fields)
        assert batch.schema == tuple(sorted(extra, key=lambda s: s.name))
    out["schema"] = _catch(lambda: plan_for(batch, dest))
    bad_layout = Destination(ParallelLayout(tp=2, dp=4))
    out["layout"] = _catch(lambda: plan_for(batches[rank], bad_layout))
    # rank 2 alone passes another config; rank 3 claims sample 0 (held by rank 0) with length 7
    cfg = PlanConfig(keep_groups=rank == 2)
    out["config"] = _catch(lambda: plan_for(batches[rank], dest, cfg))
    claim = batches[rank]
    if rank == 3:
        _, (claim,) = make_batches(schema, [7], [[0]], only_rank=0)
    out["replica"] = _catch(lambda: plan_for(claim, dest))
    return out


def test_bad_input_raises_same_error_on_every_rank():
    results = run_distributed(_body_bad_input, WORLD, timeout_s=60)
    assert all(r == results[0] for r in results), results
    errors = results[0]
    assert "sample 1 has 3000 tokens" in errors["budget"], errors
    assert "3 groups cannot fill dp=4" in errors["empty_dp"], errors
    assert "ranks disagree on the batch schema" in errors["schema"], errors
    assert "= 8 ranks, but 4 ranks dispatch" in errors["layout"], errors
    assert "ranks disagree on the plan config" in errors["config"], errors
    assert "sample 0 is held by ranks [0] with (length, group) = (100, 0)" in errors["replica"]


def _body_host_groups() -> dict:
    """One dispatch and its reverse with separate host groups forced (as on GPUs): the metadata
    all-gathers run on the host world, the payload on the (device) world group after one
    warm-up all-reduce; the result is the reference's, bitwise."""
    from megatron_earl.parallel.groups import forced_host_groups, host_group

    rank = dist.get_rank()
    schema = agentic_schema()
    lengths = agentic_lengths(12, max_len=512, seed=3, min_len=1)
    owners = [list(range(r, 12, WORLD)) for r in range(WORLD)]
    samples, batches = make_batches(schema, lengths, owners, seed=5, group_size=2)
    batch = batches[rank]
    seen: dict[str, list] = {"object": [], "p2p": [], "all_reduce": []}
    real = (dist.all_gather_object, dist.batch_isend_irecv, dist.all_reduce)

    def gather_object(out, obj, group=None):
        seen["object"].append(group)
        return real[0](out, obj, group=group)

    def batch_p2p(ops):
        seen["p2p"].extend(op.group for op in ops)
        return real[1](ops)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen["all_reduce"].append(group)
        return real[2](tensor, op=op, group=group, async_op=async_op)

    ok = True
    with forced_host_groups() as cache:
        world = host_group()
        dist.all_gather_object, dist.batch_isend_irecv, dist.all_reduce = (
            gather_object,
            batch_p2p,
            all_reduce,
        )
        try:
            plan = plan_for(batch, Destination(ParallelLayout(tp=2, dp=2)))
            for _ in range(2):
                local = execute(plan, batch)
            token = [s.name for s in schema if s.per_token]
            back = return_results(plan, local, token, [s.name for s in schema if not s.per_token])
        finally:
            dist.all_gather_object, dist.batch_isend_irecv, dist.all_reduce = real
        want = expected_local(plan, samples, rank)
        ok &= len(local.micro_batches) == len(want)
        for exp, got in zip(want, local.micro_batches):
            ok &= exp.keys() == got.fields.keys()
            ok &= all(tensors_equal(exp[k], got.fields[k]) for k in exp)
        for sid in back.sample_ids:
            ok &= all(tensors_equal(back.sample(sid)[k], v) for k, v in batch.sample(sid).items())
        warmups = cache.stats.p2p_warmups
    return {
        "ok": ok,
        "objects_on_host_world": bool(seen["object"]) and all(g is world for g in seen["object"]),
        "num_p2p_ops": len(seen["p2p"]),
        "p2p_on_device_world": all(g in (None, dist.GroupMember.WORLD) for g in seen["p2p"]),
        "all_reduces": [g is None for g in seen["all_reduce"]],
        "warmups": warmups,
    }


def test_host_groups_carry_metadata_and_device_groups_data():
    results = run_distributed(_body_host_groups, WORLD, timeout_s=120)
    for res in results:
        assert res["ok"] and res["objects_on_host_world"] and res["p2p_on_device_world"], res
        # one warm-up all-reduce over the world before its first batched p2p, then none
        assert res["warmups"] == 1 and res["all_reduces"] == [True], res
    assert any(r["num_p2p_ops"] for r in results)


def _body_plan_cache() -> dict:
    """The same inputs reuse the cached plan; a change on one rank only (one sample's length,
    hence its data) or in the destination plans anew, and the new plan's result is the
    reference's; the same samples to another destination of the same dp reuse the balance."""
    from megatron_earl.dispatch.execute import PlanCache

    rank = dist.get_rank()
    schema = agentic_schema()
    lengths = agentic_lengths(12, max_len=512, seed=9, min_len=1)
    owners = [list(range(r, 12, WORLD)) for r in range(WORLD)]
    _, batches = make_batches(schema, lengths, owners, seed=2)
    cache = PlanCache()
    dest = Destination(ParallelLayout(tp=2, dp=2))
    first = plan_for(batches[rank], dest, cache=cache)
    again = plan_for(batches[rank], dest, cache=cache)
    out = {"reused": again is first, "view": first.rank == rank}
    changed = list(lengths)
    changed[6] += 1  # sample 6 lives on rank 2: only that rank's batch differs
    samples2, batches2 = make_batches(schema, changed, owners, seed=2)
    plan2 = plan_for(batches2[rank], dest, cache=cache)
    local = execute(plan2, batches2[rank])
    want = expected_local(plan2, samples2, rank)
    out["new_plan"] = plan2 is not first and plan2.samples[6].length == changed[6]
    out["correct"] = all(
        tensors_equal(exp[k], got.fields[k])
        for exp, got in zip(want, local.micro_batches, strict=True)
        for k in exp
    )
    other = plan_for(batches[rank], Destination(ParallelLayout(cp=2, dp=2)), cache=cache)
    out["other_destination"] = other is not first
    out["counts"] = (cache.hits, cache.misses)
    # the other destination has the same dp: it reused the first plan's balance
    out["balances"] = (cache.balances.hits, cache.balances.misses)
    out["same_balance"] = other.assignment == first.assignment  # (also true without the memo:
    # the balance is deterministic; the reuse itself is what ``balances`` counts)
    return out


def test_plan_cache_reuses_only_identical_inputs():
    results = run_distributed(_body_plan_cache, WORLD, timeout_s=120)
    for res in results:
        assert res == {
            "reused": True,
            "view": True,
            "new_plan": True,
            "correct": True,
            "other_destination": True,
            "counts": (1, 3),
            "balances": (1, 2),  # the changed batch balanced afresh, the other dest. reused
            "same_balance": True,
        }, res
