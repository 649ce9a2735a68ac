"""``rollout.repack``: the pure repack plan, the config checks, and the relay's release gate
(its HTTP endpoint in process, no engine)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from megatron_earl.config.loader import load_config
from megatron_earl.config.repack import RepackConfig, RepackConfigError
from megatron_earl.config.run import ConfigError
from megatron_earl.rollout.repack import EngineView, Move, plan_repack
from megatron_earl.rollout.weights.relay.applier import may_load
from megatron_earl.rollout.weights.relay.server import RelayServer, RelaySettings


def views(*engines: tuple[int, int]) -> list[EngineView]:
    return [EngineView(version, True, n) for version, n in engines]


def test_lone_tails_of_a_version_move_to_its_lowest_index_engine():
    # newest is 5: engines 0-3 drain version 4, engine 4 serves 5
    plan = plan_repack(views((4, 3), (4, 1), (4, 2), (4, 0), (5, 9)), 5, below=2, max_per_engine=8)
    assert plan == [Move(1, 0, 1, 4), Move(2, 0, 2, 4)]


def test_nothing_moves_across_versions_above_below_or_past_capacity():
    assert plan_repack(views((3, 1), (4, 1)), 5, below=2, max_per_engine=8) == []  # versions
    assert plan_repack(views((4, 1), (4, 3)), 5, below=2, max_per_engine=8) == []  # 3 > below
    assert plan_repack(views((4, 7), (4, 2)), 5, below=2, max_per_engine=8) == []  # 9 > 8
    assert plan_repack(views((5, 1), (5, 1)), 5, below=2, max_per_engine=8) == []  # serving
    sick = [EngineView(4, False, 2), EngineView(4, True, 1), EngineView(4, True, 1)]
    assert plan_repack(sick, 5, below=2, max_per_engine=8) == [Move(2, 1, 1, 4)]
    assert plan_repack(views((-1, 1), (-1, 1)), 5, below=2, max_per_engine=8) == []  # unknown


def test_each_version_has_its_own_tail_engine():
    plan = plan_repack(views((3, 2), (4, 1), (3, 1), (4, 2)), 5, below=2, max_per_engine=8)
    assert plan == [Move(2, 0, 1, 3), Move(3, 1, 2, 4)]


def test_repack_config_rejects_bad_values_naming_them():
    with pytest.raises(RepackConfigError, match=r"policy 'always' is not one of"):
        RepackConfig(policy="always")
    with pytest.raises(RepackConfigError, match=r"below \(0\) must be an integer >= 1"):
        RepackConfig(below=0)
    with pytest.raises(RepackConfigError, match=r"interval_s \(0\) must be > 0"):
        RepackConfig(interval_s=0)


RELAY_RUN = [
    "rollout.engine=sglang",
    "rollout.mode=async",
    "rollout.engine_urls=[http://127.0.0.1:1,http://127.0.0.1:2]",
    "rollout.sglang.weight_update=relay",
    "rollout.sglang.relay_urls=[http://127.0.0.1:3]",
    "rollout.sglang.engine_relays=[http://127.0.0.1:4,http://127.0.0.1:4]",
]


def test_repack_run_config_names_every_missing_piece():
    ok = load_config(
        "configs/bench_async_longtail.yaml", [*RELAY_RUN, "rollout.repack.policy=repack"]
    )
    assert ok.rollout.repack.enabled and len(ok.rollout.sglang.engine_relays) == 2
    with pytest.raises(ConfigError) as err:
        load_config(
            "configs/bench_async_longtail.yaml",
            [
                "rollout.engine=sglang",
                "rollout.engine_urls=[http://127.0.0.1:1,http://127.0.0.1:2]",
                "rollout.partial_rollout=restart",
                "rollout.sglang.router_url=http://127.0.0.1:9",
                "rollout.repack.policy=drain",
            ],
        )
    text = str(err.value)
    for needle in (
        "needs mode 'async', got 'sync'",
        "needs partial_rollout 'continue'",
        "drop sglang.router_url (http://127.0.0.1:9)",
        "needs sglang.weight_update 'relay'",
        "0 relays for 2 engines",
    ):
        assert needle in text


def test_relay_loads_a_held_engine_only_once_every_holder_released_it():
    engine = "http://127.0.0.1:1"
    server = RelayServer(RelaySettings(engines=(engine,), release_holders=2))
    state = server.engines[engine]
    assert may_load(state, 2)  # never loaded by this relay: a first load needs no release
    state.loaded = state.version = 4

    async def run():
        app = server.app()
        app.on_startup.clear()  # no background tasks: no engine to reach
        app.on_cleanup.clear()
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/engines/release"
        out, checks = [], []
        async with aiohttp.ClientSession() as s:
            for body in (
                {"engine": engine, "holder": "rank0"},
                {"engine": engine, "holder": "rank0"},
                {"engine": "http://127.0.0.1:7", "holder": "rank0"},
                {"engine": engine},
                {"engine": engine, "holder": "rank1"},
            ):
                async with s.post(url, json=body) as r:
                    out.append((r.status, await r.json()))
                checks.append(may_load(state, 2))
            # a release sent for a version the engine no longer serves is refused, not counted
            stale = {"engine": engine, "holder": "rank9", "version": 3}
            async with s.post(url, json=stale) as r:
                refused = (r.status, (await r.json())["error"]["message"])
            # a load clears the releases; a detached holder's release stands for later versions
            state.released_by.clear()
            for body in (
                {"engine": engine, "holder": "rank1", "detach": True},
                None,  # the next version is loaded
                {"engine": engine, "holder": "rank0"},
                {"engine": engine, "holder": "rank1", "attach": True},
            ):
                if body is None:
                    state.released_by.clear()
                else:
                    async with s.post(url, json=body) as r:
                        assert r.status == 200
                checks.append(may_load(state, 2))
        await runner.cleanup()
        return out, checks, refused

    out, checks, refused = asyncio.run(run())
    assert refused[0] == 409 and "for version 3: the engine serves 4" in refused[1]
    assert [status for status, _ in out] == [200, 200, 404, 400, 200]
    assert out[0][1] == {"released": 1, "holders": 2, "version": 4}
    assert out[1][1]["released"] == 1  # the same holder twice counts once
    assert "not fed by this relay" in out[2][1]["error"]["message"]
    assert "holder must be a non-empty string" in out[3][1]["error"]["message"]
    # rank0, rank0 again, unknown engine, no holder, rank1: loadable; then rank1 detaches
    # (1 of 2), a load, rank0 releases (with rank1's standing release: 2 of 2), rank1 attaches
    assert checks == [False, False, False, False, True, False, False, True, False]
    state.version = 2  # the engine restarted (it reports a version the relay never loaded)
    state.released_by.clear()
    assert may_load(state, 2)


def test_utilisation_sums_the_ranks_latest_samples_per_bin(tmp_path):
    from megatron_earl.bench.repack import utilisation

    def write(rank: int, rows: list[tuple[float, list[int]]]) -> None:
        with (tmp_path / f"repack_rank{rank}.jsonl").open("w") as f:
            for t, loads in rows:
                engines = [[3, 0, n] for n in loads]
                f.write(json.dumps({"t": t, "holder": f"rank{rank}", "engines": engines}) + "\n")
            f.write(json.dumps({"t": 0.1, "holder": f"rank{rank}", "event": "repack"}) + "\n")

    write(0, [(100.0, [4, 1]), (100.3, [2, 0]), (100.6, [0, 0])])
    write(1, [(100.1, [1, 1]), (100.55, [3, 0])])
    u = utilisation(tmp_path, engines=2, bin_s=0.25)
    assert u["t"] == [0.0, 0.25, 0.5]
    # bin 0: rank0 [4,1] + rank1 [1,1]; bin 1: rank0 [2,0] + rank1 still [1,1];
    # bin 2: rank0 [0,0] + rank1 [3,0]
    assert u["batch"] == [[5, 2], [3, 1], [3, 0]]
    assert u["mean_batch"] == pytest.approx(14 / 6)
    assert u["tail_fraction"] == pytest.approx(2 / 6)  # the 1 and the 0
