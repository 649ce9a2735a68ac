"""``rollout.repack`` with real processes: two ``megatron-earl serve`` engines fed by one relay
started with ``--release-holders 1`` (it loads an engine only when released), a root relay the
test publishes to, and one rank's ``Placement`` over an ``EnginePool`` of the two engines.

- drain: an engine behind the newest version keeps the version its trajectories started on and
  takes no new one; a new trajectory waits until an engine is emptied, released and loaded.
- repack: the lone trajectory of one draining engine moves to the other (same version: its next
  turn is generated there on the same weights), the freed engine is loaded at once and starts
  the new trajectory; the other is loaded when its trajectories end. Events are recorded.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from megatron_earl.config.repack import RepackConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.engine import GenerateRequest
from megatron_earl.rollout.repack import Placement, relay_holders, release_holder_problems
from megatron_earl.rollout.sglang.client import SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess
from megatron_earl.rollout.sglang.pool import EnginePool
from megatron_earl.rollout.weights.relay.launch import RelayLaunch, RelayProcess
from megatron_earl.rollout.weights.relay.publisher import RelayPublisher, wait_for_engines
from megatron_earl.rollout.weights.sync import hf_named_tensors
from megatron_earl.testing.distributed import free_port, run_distributed
from tests.integration.test_relay import ENV, FAST, MODEL, PROMPT, weights

pytestmark = pytest.mark.timeout(240)

TURN = SamplingParams(max_new_tokens=3, temperature=0.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repack")
    (tmp / "model.json").write_text(json.dumps(MODEL.to_dict()))
    args = ("--model-config", str(tmp / "model.json"), "--max-seq-len", "64")
    engines = [
        ServerProcess(
            LaunchConfig(
                model_path="random",
                port=free_port(),
                module="megatron_earl.rollout.serve.server",
                extra_args=args,
            ),
            log_path=str(tmp / f"e{i}.log"),
            env=ENV,
            rebind_on_conflict=True,
        )
        for i in range(2)
    ]
    relays = []
    try:
        for e in engines:
            e.wait_healthy(timeout_s=120)
        urls = [e.url for e in engines]
        root = RelayProcess(
            RelayLaunch(free_port(), extra_args=FAST), log_path=str(tmp / "R0.log"), env=ENV
        )
        relays.append(root)
        root.wait_healthy(timeout_s=60, path="/health")
        feed = RelayProcess(
            RelayLaunch(
                free_port(),
                upstreams=(root.url,),
                engines=tuple(urls),
                extra_args=(*FAST, "--release-holders", "1"),
            ),
            log_path=str(tmp / "F.log"),
            env=ENV,
        )
        relays.append(feed)
        feed.wait_healthy(timeout_s=60, path="/health")
        yield {"urls": urls, "root": root.url, "feed": feed.url, "tmp": tmp, "version": [0]}
    finally:
        for p in [*reversed(relays), *engines]:
            p.stop(stop_timeout_s=10)


async def _publish(setup, seed: int) -> int:
    setup["version"][0] += 1
    version = setup["version"][0]
    named = hf_named_tensors(weights(seed), MODEL)
    await RelayPublisher([setup["root"]], 60).publish(named, version, 16 << 10)
    return version


async def _turn(pool: EnginePool, uid: str) -> int:
    """One model turn of trajectory ``uid``; the weight version that generated it."""
    result = await pool.generate(GenerateRequest(PROMPT, TURN, session=uid))
    return result.weight_version


async def _start(setup, policy: str, name: str):
    """A placement, and every engine on a fresh version (the placement releases the engines,
    which hold nothing yet)."""
    version = await _publish(setup, 1)
    clients = [SGLangClient(u) for u in setup["urls"]]
    pool = EnginePool(clients)
    config = RepackConfig(policy=policy, below=2, interval_s=0.05)
    timeline = setup["tmp"] / f"{name}.jsonl"
    placement = Placement(pool, [setup["feed"]] * 2, config, holder="rank0", timeline=timeline)
    placement.start()
    placement.set_newest(version)
    await wait_for_engines(clients, version, 60)
    return pool, placement, version, timeline


def test_drain_keeps_each_trajectory_on_its_version_and_new_ones_wait(setup):
    async def run():
        pool, placement, v1, _ = await _start(setup, "drain", "drain")
        try:
            assert [await placement.begin(u) for u in ("a", "b", "c")] == [0, 1, 0]
            assert {await _turn(pool, u) for u in ("a", "b", "c")} == {v1}
            v2 = await _publish(setup, 2)
            placement.set_newest(v2)
            waiting = asyncio.ensure_future(placement.begin("d"))
            await asyncio.sleep(1.5)  # both engines hold trajectories of v1: nobody is loaded
            assert not waiting.done()
            assert {await _turn(pool, u) for u in ("a", "b", "c")} == {v1}
            placement.end("b")  # engine 1 empties: released, loaded, then it takes "d"
            assert await asyncio.wait_for(waiting, 30) == 1
            assert await _turn(pool, "d") == v2
            assert await _turn(pool, "a") == v1  # engine 0 still holds a and c on v1
            assert placement.repacks == 0 and placement.waits == 1
        finally:
            await placement.close()
            await pool.close()

    asyncio.run(run())


def test_repack_frees_an_engine_for_the_new_version_without_mixing_versions(setup):
    async def run():
        pool, placement, v1, timeline = await _start(setup, "repack", "repack")
        try:
            assert [await placement.begin(u) for u in ("a", "b", "c")] == [0, 1, 0]
            assert {await _turn(pool, u) for u in ("a", "b", "c")} == {v1}
            v2 = await _publish(setup, 3)
            placement.set_newest(v2)
            # b (alone on engine 1) moves to engine 0; engine 1 is released and loaded
            assert await asyncio.wait_for(placement.begin("d"), 30) == 1
            assert pool.engine_of("b") == 0
            assert await _turn(pool, "b") == v1  # its next turn: engine 0, still v1's weights
            assert await _turn(pool, "d") == v2
            for uid in ("a", "b", "c"):
                placement.end(uid)
            clients = [SGLangClient(u) for u in setup["urls"]]
            await wait_for_engines(clients, v2, 30)  # engine 0 empty: released and loaded
            await asyncio.gather(*(c.close() for c in clients))
            assert placement.repacks == 1 and placement.repacked_trajectories == 1
        finally:
            await placement.close()
            await pool.close()
        events = [json.loads(line) for line in timeline.open()]
        moves = [e for e in events if e.get("event") == "repack"]
        assert [(m["source"], m["target"], m["trajectories"], m["version"]) for m in moves] == [
            (1, 0, 1, v1)
        ]
        after = events[events.index(moves[0]) :]
        released = [e["engine"] for e in after if e.get("event") == "release"]
        assert released[:2] == [1, 0]  # the freed engine first, the tail engine when emptied
        assert any("engines" in e for e in events)

    asyncio.run(run())


def _check_relays(relays: list[str]) -> str:
    from megatron_earl.orchestration.loop import check_engine_relays

    try:
        check_engine_relays(relays)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_relays_waiting_for_another_number_of_holders_are_refused(setup):
    """The trainer's pre-flight (``check_engine_relays``): every engine relay must wait for
    one release per trainer process; each one that does not, or does not answer, is named, and
    every rank raises the same error (rank 0 asks, the answers are broadcast)."""
    assert release_holder_problems(relay_holders([setup["feed"]]), 1) == []  # 1 holder: fine
    gone = f"http://127.0.0.1:{free_port()}"
    relays = [setup["feed"], setup["root"], gone]
    first, second = run_distributed(_check_relays, 2, args=(relays,), timeout_s=120)
    assert first == second  # the same error on every rank
    assert f"engine relay {setup['feed']} was started with --release-holders 1" in first
    assert f"engine relay {setup['root']} was started with --release-holders 0" in first
    assert f"engine relay {gone} did not tell its --release-holders: no answer" in first
    assert first.count("needs 2 (one release per trainer process)") == 2


def test_an_engine_whose_relay_did_not_acknowledge_the_attach_takes_no_trajectory(setup):
    """A holder attaches to every engine's relay at start (a detach of an earlier run would
    otherwise stand); until a relay acknowledges, its engine takes none of this rank's
    trajectories. The attach is tried again in the background: once the relay is up, the
    engine is attached, released and takes trajectories."""
    port = free_port()  # engine 1's relay: started only later
    late_url = f"http://127.0.0.1:{port}"
    late: list[RelayProcess] = []

    def start_late() -> None:
        launch = RelayLaunch(
            port, engines=(setup["urls"][1],), extra_args=(*FAST, "--release-holders", "1")
        )
        late.append(RelayProcess(launch, log_path=str(setup["tmp"] / "late.log"), env=ENV))
        late[0].wait_healthy(timeout_s=60, path="/health")

    async def run():
        version = await _publish(setup, 1)
        clients = [SGLangClient(u) for u in setup["urls"]]
        pool = EnginePool(clients)
        config = RepackConfig(policy="drain", below=2, interval_s=0.05)
        placement = Placement(pool, [setup["feed"], late_url], config, holder="rank0")
        placement.start()
        placement.set_newest(version)
        try:
            await wait_for_engines(clients, version, 60)
            chosen = [await placement.begin(u) for u in ("a", "b", "c")]
            before = set(placement._attached)
            await asyncio.to_thread(start_late)
            # the next attach round (every RELEASE_AGAIN_S) reaches it; then "d" goes there
            # (the engine with fewer of this rank's trajectories)
            for _ in range(150):
                if 1 in placement._attached:
                    break
                await asyncio.sleep(0.1)
            chosen.append(await asyncio.wait_for(placement.begin("d"), 30))
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{late_url}/relay_info") as resp:
                    info = await resp.json()
            return chosen, before, info["engines"][setup["urls"][1]]["released_by"]
        finally:
            await placement.close()
            await pool.close()

    try:
        chosen, before, released_by = asyncio.run(run())
    finally:
        for proc in late:
            proc.stop(stop_timeout_s=10)
    assert before == {0} and chosen == [0, 0, 0, 1]
    assert released_by == ["rank0"]  # attached, then released: it held nothing of rank 0
