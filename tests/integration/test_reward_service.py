"""The stateless reward service: a separate process over HTTP (aiohttp), a client with timeout
and retry, and its use as a reward function of the agent loop.

Run: python -m pytest -q -p no:warnings tests/integration/test_reward_service.py   (~10 s)
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time

import aiohttp
import pytest
import yarl

from megatron_earl.envs import ArithmeticEnv
from megatron_earl.rewards import RewardInput, WeightedReward
from megatron_earl.rewards.service import (
    RemoteReward,
    RewardServiceError,
    launch_reward_service,
)
from megatron_earl.rollout.agent import AgentLoop, RolloutTask
from tests.integration.test_agent_loop import TOK, demo_assistant_turns, turns_engine

_calls = itertools.count()
HERE = "tests.integration.test_reward_service"


def flaky(inp: dict) -> float:
    """Fails every other call (server side state, to exercise the client's retry)."""
    if next(_calls) % 2 == 0:
        raise RuntimeError("transient failure")
    return 0.5


async def slow(inp: dict) -> float:
    await asyncio.sleep(3)
    return 1.0


def nan_reward(inp: dict) -> float:
    return float("nan")


def whoami(inp: dict) -> float:
    return float(os.getpid())


def sleepy(inp: dict) -> float:
    """A synchronous function that blocks its thread for 3 s."""
    time.sleep(3)
    return 1.0


def exits(inp: dict) -> float:
    raise SystemExit(2)


@pytest.fixture(scope="module")
def service():
    fns = {
        "exact": "exact_match",
        "flaky": f"{HERE}:flaky",
        "slow": f"{HERE}:slow",
        "nan": f"{HERE}:nan_reward",
        "pid": f"{HERE}:whoami",
        "sleepy": f"{HERE}:sleepy",
        "exits": f"{HERE}:exits",
    }
    with launch_reward_service(fns) as svc:
        yield svc


def _input(answer: str, target: str = "11") -> RewardInput:
    return RewardInput(
        "g/0", 3, {"target": target}, ["<tool_call>...</tool_call>", answer], 1.0, "done"
    )


def test_exact_match_in_a_separate_process(service):
    async def go():
        exact = RemoteReward(service.url, "exact")
        return (
            await exact(_input("11")),
            await exact(_input("the answer is 12")),
            await RemoteReward(service.url, "pid")(_input("")),
        )

    right, wrong, pid = asyncio.run(go())
    assert (right, wrong) == (1.0, 0.0)
    assert pid == service.proc.pid != os.getpid()


def test_retry_timeout_and_errors(service):
    async def go():
        flaky_fn = RemoteReward(service.url, "flaky", retries=2, backoff_s=0.05)
        value = await flaky_fn(_input("1"))
        out = {"flaky": (value, flaky_fn.num_retries)}
        for name, kw in [
            ("slow", {"timeout_s": 0.5, "retries": 1}),
            ("nan", {"retries": 1}),
            ("unknown", {"retries": 3}),
        ]:
            fn = RemoteReward(service.url, name, backoff_s=0.05, **kw)
            start = time.monotonic()
            with pytest.raises(RewardServiceError) as e:
                await fn(_input("1"))
            out[name] = (str(e.value), fn.num_retries, time.monotonic() - start)
        return out

    out = asyncio.run(go())
    assert out["flaky"][0] == 0.5 and out["flaky"][1] >= 1
    msg, retries, elapsed = out["slow"]
    assert "2 attempt(s)" in msg and "Timeout" in msg and retries == 1 and elapsed < 2.5
    assert "HTTP 500" in out["nan"][0] and "non-finite" in out["nan"][0] and out["nan"][1] == 1
    msg, retries, _ = out["unknown"]
    assert "HTTP 400" in msg and retries == 0  # a client error is not retried


def test_unreachable_service_is_retried_then_reported():
    fn = RemoteReward("http://127.0.0.1:9", "exact", timeout_s=1, retries=2, backoff_s=0.01)
    with pytest.raises(RewardServiceError, match="3 attempt"):
        asyncio.run(fn(_input("11")))
    assert fn.num_retries == 2


def test_remote_reward_in_the_agent_loop(service):
    turns = demo_assistant_turns(ArithmeticEnv(), 3)
    remote = RemoteReward(service.url, "exact", name="remote_exact")
    loop = AgentLoop(turns_engine(turns), TOK, reward_fns=[WeightedReward(remote, 0.5)])
    batch = asyncio.run(loop.run_batch([RolloutTask("arithmetic", 3)]))
    (t,) = batch.trajectories
    assert t.rewards == {"outcome": 1.0, "remote_exact": 1.0} and t.reward == 1.5


def test_run_config_wires_the_service_and_checks_it_at_start_up(service):
    """``reward.service_url`` / ``reward.fns`` / ``reward.weights`` give the agent loop its remote
    rewards (the trainer passes them to every rollout path); the start-up check names a function
    the service does not serve, and an unreachable service, before anything runs."""
    from megatron_earl.config import load_config
    from megatron_earl.rewards.service import (
        RewardServiceError,
        check_reward_service,
        remote_rewards,
    )

    config = load_config(
        overrides=[
            f"reward.service_url={service.url}",
            "reward.fns=[exact]",
            "reward.weights=[0.5]",
        ]
    ).reward
    asyncio.run(check_reward_service(config))
    rewards = remote_rewards(config)
    turns = demo_assistant_turns(ArithmeticEnv(), 3)
    loop = AgentLoop(turns_engine(turns), TOK, reward_fns=rewards)
    (t,) = asyncio.run(loop.run_batch([RolloutTask("arithmetic", 3)])).trajectories
    assert t.rewards == {"outcome": 1.0, "exact": 1.0} and t.reward == 1.5
    assert remote_rewards(load_config().reward) == []
    missing = load_config(overrides=[f"reward.service_url={service.url}", "reward.fns=[judge]"])
    with pytest.raises(RewardServiceError, match=r"reward.fns \['judge'\] are not served"):
        asyncio.run(check_reward_service(missing.reward))
    dead = load_config(overrides=["reward.service_url=http://127.0.0.1:9", "reward.fns=[exact]"])
    with pytest.raises(RewardServiceError, match="reward service not reachable at start-up"):
        asyncio.run(check_reward_service(dead.reward))


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"fn": "exact", "input": "11"}, "'input' must be an object (RewardInput fields), got str"),
        ({"fn": "exact", "input": {"task": "11"}}, "input.task must be dict, got '11'"),
        ({"fn": "exact", "input": {"turns": [1, 2]}}, "input.turns must be a list of strings"),
        ({"fn": "exact", "input": {"turns": "11"}}, "input.turns must be list"),
        ({"fn": "exact", "input": {"seed": True}}, "input.seed must be int, got True"),
        ({"fn": "exact", "input": {"outcome": "high"}}, "input.outcome must be int or float"),
        ([1, 2], "body must be {'fn': one of"),
        ({"fn": ["exact"], "input": {}}, "body must be {'fn': one of"),
    ],
)
def test_badly_shaped_input_is_a_400_not_a_500(service, body, fragment):
    """Issue 22 item 9: these answered 500 (the function failing on them), which the client
    retries although the error is the request's; now 400, and the service keeps serving."""

    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{service.url}/reward", json=body) as resp:
                answer = (resp.status, await resp.json())
            async with session.get(f"{service.url}/health") as resp:
                return answer, resp.status

    (status, answer), health = asyncio.run(go())
    assert status == 400, answer
    assert fragment in answer["error"]
    assert health == 200


def test_a_slow_sync_function_does_not_block_other_clients(service):
    """Issue 22 item 9: a synchronous function that sleeps 3 s ran on the service's event loop,
    so every other client waited for it; now it runs on a worker thread and a concurrent call of
    another function is answered at once. SystemExit in a function is a 500; the service goes
    on."""

    async def timed(fn: str, answer: str = "11"):
        start = time.monotonic()
        value = await RemoteReward(service.url, fn, timeout_s=10, retries=0)(_input(answer))
        return value, time.monotonic() - start

    async def go():
        slow_call = asyncio.ensure_future(timed("sleepy"))
        await asyncio.sleep(0.3)  # the sleepy call is running on the service
        fast = await timed("exact")
        return fast, await slow_call

    (fast_value, fast_s), (slow_value, slow_s) = asyncio.run(go())
    assert (fast_value, slow_value) == (1.0, 1.0)
    assert fast_s < 1.0 and slow_s >= 2.5
    with pytest.raises(RewardServiceError, match="HTTP 500: SystemExit"):
        asyncio.run(RemoteReward(service.url, "exits", retries=0)(_input("11")))
    assert asyncio.run(timed("exact"))[0] == 1.0


@pytest.mark.parametrize(
    "text,fragment",
    [
        ('{"fn": "exact", "input": {"task": {"target": "seven"}, "turns": ["7"]}}', "'seven'"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"fn": "exact", "input": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ],
)
def test_a_target_it_cannot_score_or_deep_nesting_is_a_400_not_retried(service, text, fragment):
    """The probe's inputs answered 500, which the client retries as transient."""

    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{service.url}/reward", data=text) as resp:
                return resp.status, await resp.json()

    status, answer = asyncio.run(go())
    assert status == 400 and fragment in answer["error"], answer
    client = RemoteReward(service.url, "exact", retries=3, backoff_s=0.05)
    with pytest.raises(RewardServiceError, match=r"HTTP 400.*'seven'"):
        asyncio.run(client(_input("7", target="seven")))
    assert client.num_retries == 0


def test_a_keyed_service_needs_the_key_on_every_method_but_health(monkeypatch):
    from aiohttp import web

    from megatron_earl.rewards.service import API_KEY_ENV, build_app, exact_match

    key = "reward-key-1"

    async def go():
        runner = web.AppRunner(build_app({"exact": exact_match}, api_key=key))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as s:
                for path in ("/reward", "/nowhere", "/health/../reward", "/reward/"):
                    for method in ("GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD"):
                        for headers in ({}, {"Authorization": f"Bearer {key}x"}):
                            target = yarl.URL(url + path, encoded=True)  # sent as spelled
                            async with s.request(method, target, headers=headers) as resp:
                                assert resp.status == 401, (method, path, resp.status)
                async with s.get(url + "/health") as resp:
                    assert resp.status == 200
            monkeypatch.delenv(API_KEY_ENV, raising=False)
            with pytest.raises(RewardServiceError, match="HTTP 401"):
                await RemoteReward(url, "exact", retries=1)(_input("11"))
            monkeypatch.setenv(API_KEY_ENV, key)
            return await RemoteReward(url, "exact")(_input("11"))
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == 1.0
