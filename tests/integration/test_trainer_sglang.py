"""The trainer with SGLang engines (``rollout.engine=sglang``, the disaggregated setup): two
``megatron-earl serve`` processes stand in for SGLang servers (same native HTTP API). The trainer
(2 ranks under torchrun) pushes its weights to both before each rollout (versions tagged, read
back) with each of SGLang's protocols (``rollout.sglang.weight_update``: tensor -- portable and
SGLang's own flattened-bucket payload --, disk through a
shared directory the servers allow, distributed over a gloo group with both servers), drives
multi-turn rollouts on them from every rank, and trains on the result (the switching demo config:
pinned layouts, the master in tp2; SGLang engines take no selected rollout layout). Push time and
bytes are in the metrics of every step. The servers require an API key (the trainer reads it from
``SGLANG_API_KEY``); with the distributed protocol the rollouts go through SGLang's real router
(``sglang-router``) in front of both servers, as a disaggregated job runs. The tensor run is
colocated (``rollout.sglang.colocated``): the engines release their memory after each rollout and
are resumed around the next push (timed in the metrics) and at the end of the run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_earl.config.loader import load_config
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.sglang.router import RouterConfig, RouterProcess
from megatron_earl.rollout.weights.relay.launch import RelayLaunch, RelayProcess
from megatron_earl.testing.distributed import free_port
from tests.integration.metrics_doc import check_documented

ROOT = Path(__file__).resolve().parents[2]
KEY = "trainer-test-key"
RUN = [
    "steps=2",
    "sft.steps=0",
    "eval.num_prompts=0",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "checkpoint.interval=0",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "logging.tensorboard=false",
    "logging.progress=false",
    "layouts.experience=tp1cp1pp1dp2",
]


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory) -> Path:
    """The directory the trainer writes HF weights into and the servers may read (disk)."""
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, shared_dir):
    tmp = tmp_path_factory.mktemp("engines")
    model = load_config(ROOT / "configs" / "demo_cpu_switching.yaml", RUN).model
    (tmp / "model.json").write_text(json.dumps(model.to_dict()))
    procs = [
        ServerProcess(
            LaunchConfig(
                model_path="random",
                port=free_port(),
                module="megatron_earl.rollout.serve.server",
                api_key=KEY,
                weight_dirs=(str(shared_dir),),
                extra_args=(
                    "--model-config",
                    str(tmp / "model.json"),
                    "--max-seq-len",
                    "256",
                    "--max-batch-size",
                    "16",
                ),
            ),
            log_path=str(tmp / f"server{i}.log"),
            env={"OMP_NUM_THREADS": "1"},
            rebind_on_conflict=True,
        )
        for i in range(2)
    ]
    try:
        for proc in procs:
            proc.wait_healthy(timeout_s=120)
        yield procs
    finally:
        stop_all(procs, stop_timeout_s=20)


def _version(url: str) -> int:
    async def get() -> int:
        client = SGLangClient(url, ClientConfig(api_key=KEY))
        try:
            await client.get_model_info()
            return client.weight_version
        finally:
            await client.close()

    return asyncio.run(get())


def _server_info(url: str) -> dict:
    async def get() -> dict:
        client = SGLangClient(url, ClientConfig(api_key=KEY))
        try:
            return await client.get_server_info()
        finally:
            await client.close()

    return asyncio.run(get())


SGLANG_PAYLOAD = (
    "rollout.sglang.tensor_payload=sglang",
    "rollout.sglang.tensor_load_format=flattened_bucket",
)
"""The tensor protocol with SGLang's own payload (engines on this host)."""


def _push_run(servers, shared_dir, tmp_path, protocol: str, colocated: bool) -> dict:
    """A synchronous 2-step run pushing with ``protocol`` (``tensor-sglang``: the tensor protocol
    with ``SGLANG_PAYLOAD``). Returns its metrics records and, read right after it, the weight
    versions the servers serve and (colocated) their server info."""
    urls = ",".join(p.url for p in servers)
    with contextlib.ExitStack() as stack:
        extra = []
        if protocol == "distributed":
            router = stack.enter_context(
                RouterProcess(
                    RouterConfig(port=free_port(), api_key=KEY),
                    [p.url for p in servers],
                    log_path=str(tmp_path / "router.log"),
                    rebind_on_conflict=True,
                )
            )
            router.wait_ready(timeout_s=60)
            extra.append(f"rollout.sglang.router_url={router.url}")
        if protocol == "tensor-sglang":
            protocol = "tensor"
            extra += SGLANG_PAYLOAD
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_earl.cli.main",
                "train",
                "--nproc",
                "2",
                "--config",
                str(ROOT / "configs" / "demo_cpu_switching.yaml"),
                *RUN,
                f"output_dir={tmp_path}",
                "name=sgl",
                "rollout.engine=sglang",
                f"rollout.engine_urls=[{urls}]",
                f"rollout.sglang.weight_update={protocol}",
                f"rollout.sglang.weight_dir={shared_dir / 'weights'}",
                f"rollout.sglang.colocated={str(colocated).lower()}",
                *extra,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "SGLANG_API_KEY": KEY},
        )
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        "records": [json.loads(line) for line in (tmp_path / "sgl" / "metrics.jsonl").open()],
        "versions": [_version(p.url) for p in servers],
        "infos": [_server_info(p.url) for p in servers] if colocated else [],
        "weight_files": sorted(p.name for p in (shared_dir / "weights").iterdir())
        if protocol == "disk"
        else [],
    }


@pytest.fixture(scope="module")
def sglang_payload_run(servers, shared_dir, tmp_path_factory) -> dict:
    """The tensor-sglang run, shared: its push test checks it and the async staleness-0 run is
    compared with it (the same run but for ``rollout.mode``)."""
    return _push_run(servers, shared_dir, tmp_path_factory.mktemp("sgl"), "tensor-sglang", False)


@pytest.mark.parametrize(
    ("protocol", "colocated"),
    [("tensor", True), ("tensor-sglang", False), ("disk", False), ("distributed", False)],
)
def test_trainer_pushes_weights_and_rolls_out_on_sglang_engines(
    servers, shared_dir, tmp_path, protocol, colocated, request
):
    if protocol == "tensor-sglang":
        run = request.getfixturevalue("sglang_payload_run")
    else:
        run = _push_run(servers, shared_dir, tmp_path, protocol, colocated)
    records = run["records"]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["rollout/trajectories"] == 16
        assert record["rollout/failed"] == 0
        assert record["layout/train"] == "tp2cp1pp1dp1"
        assert record["sync/weight_push_s"] >= record["sync/weight_transfer_s"] > 0
        assert record["sync/weight_push_bytes"] > 0 and record["sync/weight_push_buckets"] >= 1
        assert record["rollout/engine_retries"] == record["rollout/engine_failovers"] == 0
    check_documented(records, {"sglang", "colocated"} if colocated else {"sglang"})
    if colocated:  # released after each rollout, resumed around step 2's push and at the end
        assert all(r["rollout/memory_release_s"] > 0 for r in records)
        assert "sync/memory_resume_weights_s" not in records[0]
        assert records[1]["sync/memory_resume_weights_s"] > 0
        assert records[1]["sync/memory_resume_kv_cache_s"] > 0
        assert len(run["infos"]) == len(servers)
        for info in run["infos"]:
            assert info["released_memory"] == [], info
            assert info["kv_cache_bytes"] > 0 and info["weight_bytes"] > 0
    if protocol == "disk":  # the version the servers serve, the one before it removed
        assert run["weight_files"] == ["v1"]
    # Pushed before the rollout of step 2: the weights after one optimizer step (version 1).
    assert run["versions"] == [1, 1]


def test_unreachable_engine_stops_the_run_before_any_worker_starts_naming_it(servers, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_earl.cli.main",
            "train",
            "--nproc",
            "2",
            "--config",
            str(ROOT / "configs" / "demo_cpu_switching.yaml"),
            *RUN,
            f"output_dir={tmp_path}",
            "name=dead",
            "rollout.engine=sglang",
            f"rollout.engine_urls=[{servers[0].url},{dead}]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SGLANG_API_KEY": KEY},
    )
    assert result.returncode == 2
    # the pre-flight in torchrun's process (cli.checked_torchrun), before any worker started
    needle = f"engine error: SGLang engines not reachable at start-up (GET /health): ['{dead}']"
    assert needle in result.stderr
    assert "device:" not in result.stdout  # no rank printed its device
    assert not (tmp_path / "dead").exists()


def _train(servers, tmp_path, name: str, *overrides: str, steps: int = 3) -> list[dict]:
    """A run of ``steps`` steps on both servers (tensor pushes); returns its metrics records."""
    urls = ",".join(p.url for p in servers)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_earl.cli.main",
            "train",
            "--nproc",
            "2",
            "--config",
            str(ROOT / "configs" / "demo_cpu_switching.yaml"),
            *RUN,
            f"steps={steps}",
            f"output_dir={tmp_path}",
            f"name={name}",
            "rollout.engine=sglang",
            f"rollout.engine_urls=[{urls}]",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "SGLANG_API_KEY": KEY},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]


ASYNC_COUNTS = ("started", "produced", "consumed", "discarded", "buffered", "in_flight")


def _check_accounting(records: list[dict], groups_per_step: int, max_staleness: int) -> None:
    """Every group produced is consumed, discarded, dropped (``rollout.dynamic_sampling``) or
    buffered; a step takes exactly its groups;
    every taken trajectory is at most max_staleness steps old; its trainable tokens all train
    unless the zero-advantage skip left samples out (``train/num_skipped_samples``)."""
    for step, r in enumerate(records, start=1):
        c = {k: r[f"rollout/async_{k}_groups"] for k in ASYNC_COUNTS}
        dropped = r.get("rollout/async_dropped_groups", 0.0)
        assert c["produced"] == c["consumed"] + c["discarded"] + dropped + c["buffered"], (step, c)
        assert c["started"] == c["produced"] + c["in_flight"], (step, c)
        assert c["consumed"] == step * groups_per_step, (step, c)
        lags = [r[f"rollout/staleness_traj_lag{i}"] for i in range(max_staleness + 1)]
        assert sum(lags) == r["rollout/trajectories"] == 16, (step, lags)
        tokens = sum(r[f"rollout/staleness_token_lag{i}"] for i in range(max_staleness + 1))
        if r["train/num_skipped_samples"]:  # zero-advantage samples left out of training
            assert tokens > r["train/num_tokens"] > 0
        else:
            assert tokens == r["train/num_tokens"] > 0


def test_async_with_staleness_0_is_the_synchronous_loop(servers, tmp_path, sglang_payload_run):
    """rollout.mode=async with max_staleness 0: every group starts once its step's weights are on
    the engines and the step trains on all of them -- the synchronous run's trajectories and
    losses over 2 steps (the second on pushed weights; sampling seeds per request; the tolerance
    covers only float reduction order). The synchronous run is the tensor-sglang push test's;
    this one differs from it only in ``rollout.mode``."""
    sync = sglang_payload_run["records"]
    asyn = _train(
        servers,
        tmp_path,
        "async",
        "rollout.mode=async",
        "rollout.max_staleness=0",
        *SGLANG_PAYLOAD,
        steps=2,
    )
    for s, a in zip(sync, asyn, strict=True):
        for key in ("rollout/tokens", "train/num_tokens", "reward/mean", "success_rate"):
            assert a[key] == s[key], (key, a[key], s[key])
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert a[key] == pytest.approx(s[key], rel=1e-5, abs=1e-7), key
        assert a["rollout/staleness_traj_lag0"] == 16
        assert a["rollout/async_discarded_groups"] == a["rollout/async_buffered_groups"] == 0
    _check_accounting(asyn, groups_per_step=4, max_staleness=0)
    check_documented(asyn, {"sglang", "async"})


def test_async_restart_with_staleness_1_loses_and_repeats_no_group(servers, tmp_path):
    """max_staleness 1, partial rollouts restarted: generation runs a step ahead of training
    (groups buffered), trajectories cut by a weight push start again (counted), and the counts
    add up at every step: produced = consumed + discarded + buffered, each step takes its 4
    groups, none older than one step."""
    records = _train(
        servers,
        tmp_path,
        "restart",
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "rollout.partial_rollout=restart",
    )
    _check_accounting(records, groups_per_step=4, max_staleness=1)
    assert records[-1]["rollout/async_started_groups"] > 3 * 4  # admitted a step ahead
    assert any(r["rollout/staleness_traj_lag1"] > 0 for r in records[1:])


def test_async_dynamic_sampling_drops_equal_groups_and_accounts_for_them(servers, tmp_path):
    """rollout.dynamic_sampling with max_staleness 1: the producers buffer informative groups
    only, a dropped group frees its slot for the next prompt, and past each rank's drop budget
    (its share of max_extra_prompts per step) uninformative groups are buffered as filler, so the
    run completes even though a random policy's groups are all wrong. The counts add up at every
    step: produced = consumed + discarded + dropped + buffered, each step takes its 4 groups."""
    records = _train(
        servers,
        tmp_path,
        "dynamic",
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "rollout.dynamic_sampling.enabled=true",
        "rollout.dynamic_sampling.max_extra_prompts=4",
        steps=2,
    )
    _check_accounting(records, groups_per_step=4, max_staleness=1)
    last = records[-1]
    kinds = ("all_correct", "all_wrong", "other")
    by_verdict = sum(last[f"rollout/async_dropped_{k}_groups"] for k in kinds)
    assert last["rollout/async_dropped_groups"] == by_verdict > 0
    assert last["rollout/async_dropped_trajectories"] == 4 * last["rollout/async_dropped_groups"]
    check_documented(records, {"sglang", "async", "async_dynamic_sampling"})


def test_async_repack_runs_every_trajectory_on_one_version(servers, tmp_path):
    """rollout.repack.policy=repack with max_staleness 1: both engines fed by one relay that
    loads an engine only once both ranks released it. Every trajectory's turns come from one
    weight version, the counts add up at every step, and each rank recorded its placement
    timeline."""
    env = {"OMP_NUM_THREADS": "1", "SGLANG_API_KEY": KEY}
    root = RelayProcess(RelayLaunch(free_port()), log_path=str(tmp_path / "R0.log"), env=env)
    relays = [root]
    try:
        root.wait_healthy(timeout_s=60, path="/health")
        engines = tuple(p.url for p in servers)
        feed = RelayProcess(
            RelayLaunch(
                free_port(),
                upstreams=(root.url,),
                engines=engines,
                extra_args=("--release-holders", "2", "--engine-check-s", "0.3"),
            ),
            log_path=str(tmp_path / "F.log"),
            env=env,
        )
        relays.append(feed)
        feed.wait_healthy(timeout_s=60, path="/health")
        records = _train(
            servers,
            tmp_path,
            "repack",
            "rollout.mode=async",
            "rollout.max_staleness=1",
            "rollout.sglang.weight_update=relay",
            f"rollout.sglang.relay_urls=[{root.url}]",
            f"rollout.sglang.engine_relays=[{feed.url},{feed.url}]",
            "rollout.repack.policy=repack",
            steps=2,
        )
    finally:
        for r in reversed(relays):
            r.stop(stop_timeout_s=10)
    _check_accounting(records, groups_per_step=4, max_staleness=1)
    assert all(r["rollout/async_mixed_version_trajectories"] == 0 for r in records)
    assert records[-1]["rollout/repack_releases"] > 0
    check_documented(records, {"sglang", "async", "repack"})
    for rank in (0, 1):
        lines = (tmp_path / "repack" / f"repack_rank{rank}.jsonl").read_text().splitlines()
        assert any('"engines"' in line for line in lines)
