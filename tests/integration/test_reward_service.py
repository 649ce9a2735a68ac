"""The stateless reward service: a separate process over HTTP (aiohttp), a client with timeout
and retry, and its use as a reward function of the agent loop.

Run: python -m pytest -q -p no:warnings tests/integration/test_reward_service.py   (~10 s)
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time

import pytest

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


@pytest.fixture(scope="module")
def service():
    fns = {
        "exact": "exact_match",
        "flaky": f"{HERE}:flaky",
        "slow": f"{HERE}:slow",
        "nan": f"{HERE}:nan_reward",
        "pid": f"{HERE}:whoami",
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
