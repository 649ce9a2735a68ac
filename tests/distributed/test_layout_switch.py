"""20 alternating layout switches in the same processes: leak-free, cached, and a model built in
a layout gives bitwise-identical logits whenever that layout is active again (A -> B -> A).

After the first cycle (A -> every other layout -> A), every later return to A must show:
process-group count (``_world.pg_map`` and ``group_count``, i.e. no ``new_group`` call), Python and
OS thread counts (``threading`` and ``/proc/self/task``) equal; open fds (``/proc/self/fd``) not
above; RSS within ``RSS_TOL_MIB`` (allocator noise; a leaked gloo group costs threads and fds,
which are asserted exactly). Switch times (first, with group creation, vs cached) are printed
(``pytest -s``). ``destroy_layouts()`` returns groups, threads and fds to their values before the
first layout.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed

NUM_SWITCHES = 20
RSS_TOL_MIB = 2.0
MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=120,
    make_vocab_size_divisible_by=16,
)
# Megatron getter -> axes of ParallelLayout.groups whose rank set it must hold.
_GETTERS = {
    "get_tensor_model_parallel_group": ("tp",),
    "get_context_parallel_group": ("cp",),
    "get_pipeline_model_parallel_group": ("pp",),
    "get_data_parallel_group": ("dp",),
    "get_model_parallel_group": ("tp", "pp"),
    "get_tensor_and_context_parallel_group": ("tp", "cp"),
    "get_tensor_and_data_parallel_group": ("tp", "dp"),
}


def _resources() -> dict[str, float]:
    import torch.distributed as dist

    gc.collect()
    world = dist.distributed_c10d._world
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {
        "process_groups": len(world.pg_map),
        "group_count": world.group_count,
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_mib": rss / 2**20,
    }


def _capture_logits(logits: torch.Tensor, batch):
    return logits.float().sum() * 0.0, {"logits": logits.detach().clone()}


def _logits(chunks, batch) -> list[torch.Tensor]:
    from megatron_earl.training.schedule import forward_backward

    metrics = forward_backward(chunks, [batch], _capture_logits, forward_only=True)
    return [m["logits"] for m in metrics]


def _state_problems(layout: ParallelLayout) -> list[str]:
    """Where Megatron's parallel state does not describe ``layout`` on this rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_earl.parallel.state import process_groups

    rank, out = dist.get_rank(), []
    for getter, axes in _GETTERS.items():
        got = dist.get_process_group_ranks(getattr(ps, getter)())
        if tuple(got) != layout.group_of(rank, axes):
            out.append(f"{getter}: {got} != {layout.group_of(rank, axes)}")
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    if tuple(dist.get_process_group_ranks(dp_cp)) != layout.group_of(rank, ("cp", "dp")):
        out.append("dp-cp group")
    gloo = ps.get_data_parallel_group_gloo(with_context_parallel=True)
    if tuple(dist.get_process_group_ranks(gloo)) != layout.group_of(rank, ("cp", "dp")):
        out.append("dp-cp gloo group")
    embedding = next((g for g in layout.embedding_groups() if rank in g), None)
    if embedding and tuple(ps._EMBEDDING_GLOBAL_RANKS) != embedding:
        out.append(f"embedding ranks {ps._EMBEDDING_GLOBAL_RANKS} != {embedding}")
    if ps.get_virtual_pipeline_model_parallel_world_size() != layout.vpp:
        out.append("vpp size")
    if process_groups().tp is not ps.get_tensor_model_parallel_group():
        out.append("process_groups().tp is not Megatron's tp group")
    return out


def _switch_cycles(layout_a: ParallelLayout, others: list[ParallelLayout], seq_length: int):
    """A -> others[0] -> A -> others[1] -> A ... (NUM_SWITCHES switches). A model is built in every
    layout on its first visit (cp = 1 only: CP attention has its own tests) and its logits must
    be bitwise identical on every later visit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_earl import runtime
    from megatron_earl.parallel.groups import group_cache
    from megatron_earl.parallel.state import process_groups, use_layout
    from megatron_earl.training.step import synthetic_lm_batches

    batch = synthetic_lm_batches(MODEL.vocab_size, 1, 2, seq_length, seed=5)[0]
    baseline = _resources()
    dist.barrier()  # time group creation, not the other ranks' start-up
    start = time.perf_counter()
    use_layout(layout_a)
    first_a_s = time.perf_counter() - start
    runtime.seed(1234)
    models = {layout_a: _build_and_run(layout_a, batch)}
    collection_a = process_groups()
    problems = {str(layout_a): _state_problems(layout_a)}
    samples, times, identical, rng_ok = [], [], True, True
    for i in range(NUM_SWITCHES):
        target = others[(i // 2) % len(others)] if i % 2 == 0 else layout_a
        rng_before = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
        start = time.perf_counter()
        use_layout(target)
        times.append((str(target), time.perf_counter() - start))
        if target not in models:
            problems[str(target)] = _state_problems(target)
            # First entry re-seeds for this rank's new tp rank (Megatron: seed + 2718 + tp_rank).
            tp_seed = 1234 + 2718 + ps.get_tensor_model_parallel_rank()
            rng_ok &= tp_seed in get_cuda_rng_tracker().seeds_
            models[target] = _build_and_run(target, batch) if target.cp == 1 else None
        elif models[target] is not None:
            chunks, reference = models[target]
            logits = _logits(chunks, batch)
            identical &= len(logits) == len(reference)
            identical &= all(torch.equal(x, y) for x, y in zip(logits, reference, strict=False))
        if target != layout_a:
            rng_a = rng_before
            continue
        states = get_cuda_rng_tracker().get_states()
        rng_ok &= all(torch.equal(v, rng_a[k]) for k, v in states.items())
        identical &= process_groups() is collection_a
        samples.append(_resources())
    return {
        "baseline": baseline,
        "samples": samples,
        "first_a_s": first_a_s,
        "times": times,
        "identical": identical,
        "rng_restored": rng_ok,
        "problems": problems,
        "keys": group_cache().keys(),
        "stats": group_cache().stats,
        "num_logit_tensors": sum(len(m[1]) for m in models.values() if m is not None),
    }


def _build_and_run(layout: ParallelLayout, batch):
    from megatron_earl.models.gpt import build_model

    chunks = build_model(MODEL, vpp=layout.vpp)
    return chunks, _logits(chunks, batch)


def _check(results, others):
    first_cycle = len(others) - 1  # index of the first return to A after visiting every layout
    for rank, res in enumerate(results):
        assert res["identical"], f"rank {rank}: logits changed after switching back"
        assert res["rng_restored"], f"rank {rank}: RNG tracker states not restored"
        assert not any(res["problems"].values()), f"rank {rank}: {res['problems']}"
        assert res["keys"] == results[0]["keys"], "group cache keys differ across ranks"
        ref = res["samples"][first_cycle]
        for sample in res["samples"][first_cycle:]:
            for key in ("process_groups", "group_count", "threads", "os_threads"):
                assert sample[key] == ref[key], f"rank {rank}: {key} grew: {ref} -> {sample}"
            assert sample["fds"] <= ref["fds"], f"rank {rank}: fds grew: {ref} -> {sample}"
            assert sample["rss_mib"] <= ref["rss_mib"] + RSS_TOL_MIB, f"rank {rank}: RSS grew"
    assert any(r["num_logit_tensors"] for r in results), "no rank produced logits"
    res = results[0]
    cached = [t for _, t in res["times"][2 * len(others) :]]
    first = [f"{name} {t * 1e3:.1f} ms" for name, t in res["times"][: 2 * len(others)]]
    print(
        f"\nrank 0: first use_layout (creates groups) {res['first_a_s'] * 1e3:.1f} ms; "
        f"first switches {first}; cached switch mean {sum(cached) / len(cached) * 1e3:.2f} ms, max "
        f"{max(cached) * 1e3:.2f} ms; groups created {res['stats'].created}, cache hits "
        f"{res['stats'].hits}; resources after first cycle {res['samples'][first_cycle]}, last "
        f"{res['samples'][-1]}, before any layout {res['baseline']}"
    )


@pytest.mark.parametrize(
    ("world_size", "layout_a", "others"),
    [
        (2, ParallelLayout(tp=2), [ParallelLayout(dp=2)]),
        (4, ParallelLayout(tp=2, pp=2), [ParallelLayout(cp=2, dp=2), ParallelLayout(dp=4)]),
    ],
    ids=["tp2<->dp2", "tp2pp2<->cp2dp2/dp4"],
)
def test_alternating_switches_are_leak_free_and_keep_models_working(world_size, layout_a, others):
    results = run_distributed(
        _switch_cycles, world_size, args=(layout_a, others, 16), timeout_s=240
    )
    _check(results, others)


def _destroy_exactly_what_was_created():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_earl.parallel.state import destroy_layouts, use_layout

    baseline = _resources()
    use_layout(ParallelLayout(tp=2))
    use_layout(ParallelLayout(dp=2))
    created = _resources()
    destroy_layouts()
    after = _resources()
    # Megatron's own teardown destroys cached gloo groups: the next switch says so clearly.
    use_layout(ParallelLayout(tp=2))
    ps.destroy_model_parallel()
    try:
        use_layout(ParallelLayout(dp=2))
        error = ""
    except RuntimeError as err:
        error = str(err)
    return {
        "baseline": baseline,
        "created": created,
        "after": after,
        "error": error,
        "pg_map": len(dist.distributed_c10d._world.pg_map),
    }


def test_destroy_layouts_destroys_exactly_the_cached_groups():
    results = run_distributed(_destroy_exactly_what_was_created, 2, timeout_s=120)
    for res in results:
        assert res["created"]["process_groups"] > res["baseline"]["process_groups"]
        for key in ("process_groups", "os_threads", "fds"):
            assert res["after"][key] <= res["baseline"][key], (key, res)
        assert "destroyed outside the cache" in res["error"]
        assert "destroy_layouts()" in res["error"]


def _host_twins_cycle():
    """With separate host groups forced on the gloo world (as on GPUs / the emulation tier):
    every Megatron group has its host twin, Megatron's gloo groups are those twins, A -> B -> A
    creates nothing after the first cycle, and destroy_layouts() destroys the twins too."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_earl.parallel.groups import forced_host_groups, host_group
    from megatron_earl.parallel.state import destroy_layouts, use_layout

    before = _resources()
    a, b = ParallelLayout(tp=2), ParallelLayout(dp=2)
    out: dict = {"problems": []}
    with forced_host_groups() as cache:
        entered = _resources()
        world = host_group()
        for i, layout in enumerate([a, b, a, b, a]):
            use_layout(layout)
            for getter in _GETTERS:
                group = getattr(ps, getter)()
                twin = host_group(group)
                ranks = dist.get_process_group_ranks(group)
                if twin is group or dist.get_process_group_ranks(twin) != ranks:
                    out["problems"].append(f"{layout} {getter}: twin {twin} of {group}")
                if twin not in dist.distributed_c10d._world.pg_map:
                    out["problems"].append(f"{layout} {getter}: twin not live")
                if len(ranks) == dist.get_world_size() and twin is not world:
                    out["problems"].append(f"{layout} {getter}: twin is not the host world")
            for cp in (False, True):
                gloo = ps.get_data_parallel_group_gloo(with_context_parallel=cp)
                if gloo is not host_group(ps.get_data_parallel_group(with_context_parallel=cp)):
                    out["problems"].append(f"{layout}: Megatron's dp gloo group is not the twin")
            if i == 1:
                first_cycle = (_resources(), cache.stats.created)
        out["last"] = (_resources(), cache.stats.created)
        out["first_cycle"] = first_cycle
        keys = cache.keys()
        out["device_sets"] = sorted({k[0] for k in keys if k[1] == "device"})
        out["host_sets"] = sorted({k[0] for k in keys if k[1] == "host"})
        out["roles"] = sorted({k[1] for k in keys})
        out["keys"] = keys
        destroy_layouts()
        out["destroyed"] = _resources()
    out.update(before=before, entered=entered, after=_resources())
    return out


def test_host_twins_are_created_reused_and_destroyed():
    results = run_distributed(_host_twins_cycle, 2, timeout_s=120)
    for rank, res in enumerate(results):
        assert not res["problems"], (rank, res["problems"])
        assert res["keys"] == results[0]["keys"], "group cache keys differ across ranks"
        assert res["roles"] == ["device", "host"]
        # one twin per device rank set (the world's is the host world), nothing else
        assert res["host_sets"] == sorted({*res["device_sets"], (0, 1)})
        assert res["device_sets"] == [(0,), (0, 1), (1,)]
        # A -> B -> A -> B -> A: nothing created after the first visit of B
        (first, created_first), (last, created_last) = res["first_cycle"], res["last"]
        assert created_last == created_first
        for key in ("process_groups", "group_count", "threads", "os_threads"):
            assert last[key] == first[key], (rank, key, first, last)
        # the host world on entry; every twin and device group gone after destroy_layouts()
        assert res["entered"]["process_groups"] == res["before"]["process_groups"] + 1
        assert res["destroyed"]["process_groups"] == res["entered"]["process_groups"]
        assert res["after"]["process_groups"] == res["before"]["process_groups"]
