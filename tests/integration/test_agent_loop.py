"""Agent loop driven by a scripted fake policy: exact token ids, loss masks and log-prob
alignment through every built-in environment; limits; bad tool calls; trajectory-level
asynchrony (a 5 s environment does not hold up the others); failing environments and engines
are contained per trajectory and counted in metrics.

Run: python -m pytest -q -p no:warnings tests/integration/test_agent_loop.py   (~10 s)
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

import pytest

from megatron_earl.envs import (
    ENVS,
    Action,
    ArithmeticEnv,
    Environment,
    GuessingEnv,
    ResetResult,
    StepResult,
)
from megatron_earl.rewards import WeightedReward
from megatron_earl.rollout.agent import (
    AgentLoop,
    AgentLoopConfig,
    EndReason,
    RolloutTask,
    TrajectoryStatus,
    assistant_turn_ids,
    demonstration_tokens,
)
from megatron_earl.rollout.engine import (
    EngineError,
    FinishReason,
    FinishType,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from megatron_earl.tokenizer import DemoTokenizer

TOK = DemoTokenizer()


def fake_logprob(token: int, k: int) -> float:
    """The scripted policy's log-prob of the k-th token of a turn (position-dependent, so any
    misalignment between ids and log-probs shows)."""
    return -(1 + token % 97) / 100 - 0.001 * k


class ScriptedEngine:
    """An Engine that answers each session's turns from a script (token ids), honouring
    max_new_tokens and stop ids like a real engine; counts requests in flight."""

    def __init__(
        self,
        script: Callable[[GenerateRequest, int], list[int]],
        delay_s: float = 0.0,
        bump_version: bool = False,
    ) -> None:
        self.script, self.delay_s, self.bump_version = script, delay_s, bump_version
        self._version = 0
        self.turn_of: dict[str | None, int] = defaultdict(int)
        self.requests: list[GenerateRequest] = []
        self.in_flight = self.max_in_flight = 0

    @property
    def weight_version(self) -> int:
        return self._version

    async def health(self) -> bool:
        return True

    async def abort(self, rid: str) -> None:
        pass

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            turn = self.turn_of[request.session]
            self.turn_of[request.session] += 1
            ids = self.script(request, turn)[: request.sampling.max_new_tokens]
            stop = ids[-1] in request.sampling.stop_token_ids
            finish = (
                FinishReason(FinishType.STOP, ids[-1]) if stop else FinishReason(FinishType.LENGTH)
            )
            version = self._version
            if self.bump_version:
                self._version += 1
            return GenerateResult(
                request.rid,
                tuple(ids),
                tuple(fake_logprob(t, k) for k, t in enumerate(ids)),
                finish,
                version,
                len(request.input_ids),
            )
        finally:
            self.in_flight -= 1


def turns_engine(turns: list[str], **kw) -> ScriptedEngine:
    """Every session plays the same assistant turns (texts)."""
    return ScriptedEngine(lambda req, t: assistant_turn_ids(turns[t], TOK), **kw)


def demo_assistant_turns(env: Environment, seed: int) -> list[str]:
    return [m["content"] for m in env.demonstration(seed) if m["role"] == "assistant"]


def run(loop: AgentLoop, tasks: list[RolloutTask]):
    return asyncio.run(loop.run_batch(tasks))


def check_alignment(traj) -> None:
    """Model tokens carry the policy's log-probs at their own positions; observations 0/0."""
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.rollout_logprobs)
    covered = set()
    for turn in traj.turns:
        for k, i in enumerate(range(turn.start, turn.end)):
            assert traj.loss_mask[i] == 1
            assert traj.rollout_logprobs[i] == fake_logprob(traj.response_ids[i], k)
            covered.add(i)
    for i in set(range(len(traj.response_ids))) - covered:
        assert traj.loss_mask[i] == 0 and traj.rollout_logprobs[i] == 0.0


def test_arithmetic_exact_tokens():
    """Hand-built expected ids for one arithmetic episode (seed 3: 1+9+1 = 11)."""
    env_spec = {"name": "arithmetic", "kwargs": {"difficulty": 2}}
    turns = demo_assistant_turns(ENVS.build(env_spec), 3)
    batch = run(AgentLoop(turns_engine(turns), TOK), [RolloutTask(env_spec, 3, "g")])
    (traj,) = batch.trajectories
    im_start, im_end, nl = 2, 3, TOK.encode("\n")
    assert traj.prompt_ids == [
        im_start,
        *TOK.encode("user\n1+9+1"),
        im_end,
        *nl,
        im_start,
        *TOK.encode("assistant\n"),
    ]
    call_text = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+9+1"}}'
    call = [*TOK.encode(call_text + "</tool_call>"), im_end]
    obs = [
        *nl,
        im_start,
        *TOK.encode("tool\n<tool_response>11</tool_response>"),
        im_end,
        *nl,
        im_start,
        *TOK.encode("assistant\n"),
    ]
    answer = [*TOK.encode("11"), im_end]
    assert traj.response_ids == call + obs + answer
    assert traj.loss_mask == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    expected_lp = [fake_logprob(t, k) for k, t in enumerate(call)] + [0.0] * len(obs)
    expected_lp += [fake_logprob(t, k) for k, t in enumerate(answer)]
    assert traj.rollout_logprobs == expected_lp
    assert (traj.status, traj.end_reason, traj.reward) == (TrajectoryStatus.OK, EndReason.DONE, 1)
    assert traj.info["tool_calls"] == 1 and traj.num_turns == 2


@pytest.mark.parametrize(
    "env_spec",
    [
        {"name": "arithmetic", "kwargs": {"difficulty": 3}},
        {"name": "guessing", "kwargs": {"difficulty": 4}},
        {"name": "python_sum", "kwargs": {"difficulty": 1}},
        {"name": "longtail", "kwargs": {"scale": 4, "max_turns": 8}},
    ],
    ids=lambda s: s["name"],
)
def test_demonstration_replays_token_for_token(env_spec):
    """A policy sampling the demonstration's assistant turns reproduces the SFT sequence
    exactly (ids, mask), with aligned log-probs and reward 1, for a group of 3 samples."""
    seed = 11
    env = ENVS.build(env_spec)
    demo = env.demonstration(seed)
    prompt, response, mask = demonstration_tokens(demo, TOK)
    engine = turns_engine(demo_assistant_turns(env, seed), bump_version=True)
    loop = AgentLoop(engine, TOK, AgentLoopConfig(group_size=3, max_turns=8))
    batch = run(loop, [RolloutTask(env_spec, seed, "grp")])
    assert len(batch.trajectories) == 3
    for i, traj in enumerate(batch.trajectories):
        assert (traj.group_id, traj.sample_index, traj.seed) == ("grp", i, seed)
        assert traj.prompt_ids == prompt
        assert traj.response_ids == response
        assert traj.loss_mask == mask
        check_alignment(traj)
        assert traj.end_reason is EndReason.DONE and traj.reward == 1.0, traj.to_dict()
        assert len(traj.weight_versions) == sum(m["role"] == "assistant" for m in demo)
    versions = sorted(v for t in batch.trajectories for v in t.weight_versions)
    assert versions == list(range(len(versions)))  # each turn records the version it ran on
    assert batch.metrics.num_ok == 3 and batch.metrics.mean_reward == 1.0


def test_guessing_context_grows_and_difficulty_sets_turns():
    for difficulty in (2, 5):
        env = ENVS.build("guessing", difficulty=difficulty)
        worst = max(len(demo_assistant_turns(env, s)) for s in range(64))
        assert worst == difficulty  # binary search: the difficulty is the number of turns
    env = ENVS.build("guessing", difficulty=5)
    seed = next(s for s in range(64) if len(demo_assistant_turns(env, s)) == 5)
    engine = turns_engine(demo_assistant_turns(env, seed))
    batch = run(
        AgentLoop(engine, TOK), [RolloutTask(lambda: ENVS.build("guessing", difficulty=5), seed)]
    )
    (traj,) = batch.trajectories
    assert traj.num_turns == 5 and traj.reward == 1.0
    contexts = [len(r.input_ids) for r in engine.requests]
    assert len(contexts) == 5 and all(a < b for a, b in itertools.pairwise(contexts))
    # Each request's context is exactly the previous one + its turn + the observation.
    for prev, nxt in itertools.pairwise(engine.requests):
        assert nxt.input_ids[: len(prev.input_ids)] == prev.input_ids


def test_bad_tool_calls_become_observations():
    turns = [
        '<tool_call>{"name": "calculator", "arguments": </tool_call>',  # invalid JSON
        '<tool_call>{"name": "abacus", "arguments": {"expression": "1"}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+9+1"}}</tool_call>',
        "11",
    ]
    cfg = AgentLoopConfig(format_reward_weight=0.5)
    batch = run(AgentLoop(turns_engine(turns), TOK, cfg), [RolloutTask("arithmetic", 3)])
    (traj,) = batch.trajectories
    assert traj.end_reason is EndReason.DONE and traj.rewards["outcome"] == 1.0
    observations = [
        TOK.decode(traj.response_ids[a.end : b.start]) for a, b in zip(traj.turns, traj.turns[1:])
    ]
    assert "invalid tool call: not valid JSON" in observations[0]
    assert "unknown tool 'abacus'; available: ['calculator']" in observations[1]
    assert "invalid arguments for calculator" in observations[2]
    assert "<tool_response>11</tool_response>" in observations[3]
    assert traj.rewards["format"] == 4 / 5  # the invalid-JSON turn is malformed
    assert traj.reward == 1.0 + 0.5 * 4 / 5
    check_alignment(traj)


def test_limits_end_reasons():
    wrong = [str(0)] * 20
    env = lambda: ENVS.build("guessing", difficulty=3, max_guesses=100)
    # max_turns: 3 model turns, 2 observations between them, none after the last.
    (t,) = run(
        AgentLoop(turns_engine(wrong), TOK, AgentLoopConfig(max_turns=3)), [RolloutTask(env, 1)]
    ).trajectories
    assert t.end_reason is EndReason.MAX_TURNS and t.num_turns == 3 and t.ok
    assert t.response_ids[-1] == TOK.end_of_turn_id
    # sampling.max_new_tokens: a turn cut without a stop token is not sent to the env.
    long = ScriptedEngine(lambda req, k: TOK.encode("1" * 50))
    (t,) = run(
        AgentLoop(long, TOK, AgentLoopConfig(sampling=SamplingParams(max_new_tokens=8))),
        [RolloutTask(env, 1)],
    ).trajectories
    assert t.end_reason is EndReason.TURN_LENGTH and len(t.response_ids) == 8
    assert t.turns[0].finish == "length"
    # max_context_tokens: the turn gets only the budget left; an observation that would not
    # fit is not appended (nothing is truncated).
    engine = turns_engine(wrong)
    prompt_len = len(TOK.render_messages([{"role": "user", "content": "guess 1-7"}], True))
    cfg = AgentLoopConfig(
        max_context_tokens=prompt_len + 5, sampling=SamplingParams(max_new_tokens=64)
    )
    (t,) = run(AgentLoop(engine, TOK, cfg), [RolloutTask(env, 1)]).trajectories
    assert engine.requests[0].sampling.max_new_tokens == 5
    assert t.end_reason is EndReason.CONTEXT_LIMIT and t.num_turns == 1
    assert t.info["dropped_observation_tokens"] > 0
    assert len(t.token_ids) == prompt_len + 2


class StopStringEngine(ScriptedEngine):
    """A ScriptedEngine that also ends a turn at the request's stop strings, as the embedded
    engine and SGLang do (the ids that complete the string are kept)."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await super().generate(request)
        for n in range(1, len(result.output_ids) + 1):
            text = TOK.decode(list(result.output_ids[:n]))
            matched = next((s for s in request.sampling.stop if s in text), None)
            if matched is not None:
                return dataclasses.replace(
                    result,
                    output_ids=result.output_ids[:n],
                    output_logprobs=result.output_logprobs[:n],
                    finish_reason=FinishReason(FinishType.STOP, matched),
                )
        return result


def test_configured_stops_end_a_turn_like_the_tokenizers():
    """``sampling.stop`` and ``sampling.stop_token_ids`` go into every request next to the
    tokenizer's stop ids, and a turn they end is complete: the environment gets it (a stop
    string kept in the text, a stop id removed) and the episode goes on from it as it is."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+9+1"}}</tool_call>'
    bang = TOK.encode("!")[0]
    turns = [TOK.encode(call + " and more"), TOK.encode("11!")]
    engine = StopStringEngine(lambda req, t: turns[t])
    sampling = SamplingParams(stop=("</tool_call>",), stop_token_ids=(bang,))
    config = AgentLoopConfig(sampling=sampling, format_reward_weight=1.0)
    (t,) = run(AgentLoop(engine, TOK, config), [RolloutTask("arithmetic", 3)]).trajectories
    assert (t.end_reason, t.rewards) == (EndReason.DONE, {"outcome": 1.0, "format": 1.0})
    assert [r.sampling.stop for r in engine.requests] == [("</tool_call>",)] * 2
    assert engine.requests[0].sampling.stop_token_ids == (*TOK.stop_ids, bang)
    first, second = (t.response_ids[turn.start : turn.end] for turn in t.turns)
    assert (first, second) == (TOK.encode(call), TOK.encode("11!"))
    assert [turn.finish for turn in t.turns] == ["stop", "stop"]
    check_alignment(t)


class SlowEnv(GuessingEnv):
    """A one-step episode (secret 1 of 1) whose step sleeps 5 s."""

    def __init__(self) -> None:
        super().__init__(difficulty=1)

    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(5.0)
        return await super().step(action)


class RaisingEnv(ArithmeticEnv):
    async def step(self, action: Action) -> StepResult:
        raise RuntimeError("environment exploded")


class HangingEnv(ArithmeticEnv):
    async def step(self, action: Action) -> StepResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class GarbageEnv(ArithmeticEnv):
    async def step(self, action: Action):
        return {"observation": 42, "reward": "lots"}


class BrokenCtorEnv(ArithmeticEnv):
    def __init__(self) -> None:
        raise OSError("no such dataset")


class GarbageResetEnv(Environment):
    async def reset(self, seed: int):
        return ResetResult(prompt=[{"role": "user"}])

    async def step(self, action: Action) -> StepResult:
        raise AssertionError("unreachable")


def test_slow_env_does_not_block_and_failures_are_contained():
    """One env sleeps 5 s in its step; three fail (raise / hang past the 6 s timeout / garbage),
    one returns a garbage prompt, one fails in its constructor. The 8 healthy trajectories
    finish without waiting, the batch completes and metrics count each failure. Engine
    concurrency is bounded at 2."""
    seed = 3
    turns = demo_assistant_turns(ArithmeticEnv(), seed)
    engine = ScriptedEngine(
        lambda req, t: assistant_turn_ids("1" if req.session.startswith("slow") else turns[t], TOK),
        delay_s=0.02,
    )
    loop = AgentLoop(engine, TOK, AgentLoopConfig(env_timeout_s=6.0, max_concurrency_per_engine=2))
    tasks = [
        RolloutTask(SlowEnv, seed, "slow"),
        RolloutTask(RaisingEnv, seed, "raise"),
        RolloutTask(HangingEnv, seed, "hang"),
        RolloutTask(GarbageEnv, seed, "garbage"),
        RolloutTask(GarbageResetEnv, seed, "garbage_reset"),
        RolloutTask(BrokenCtorEnv, seed, "broken_ctor"),
    ]
    tasks += [RolloutTask(ArithmeticEnv, seed, f"fast{i}") for i in range(8)]
    batch = run(loop, tasks)
    by = {t.group_id: t for t in batch.trajectories}
    fast = [by[f"fast{i}"] for i in range(8)]
    slowest_fast = max(t.wall_s for t in fast)
    print(
        f"healthy trajectories: slowest {slowest_fast:.3f}s; env with a 5 s step: "
        f"{by['slow'].wall_s:.2f}s; batch {batch.metrics.wall_s:.2f}s"
    )
    assert all(t.ok and t.reward == 1.0 for t in fast)
    assert slowest_fast < 2.0  # they never waited for the 5 s step (typically ~0.1 s)
    assert by["slow"].ok and by["slow"].wall_s >= 5.0 and by["slow"].reward == 1.0
    assert by["raise"].end_reason is EndReason.ENV_ERROR
    assert "environment exploded" in by["raise"].error
    assert by["hang"].end_reason is EndReason.ENV_TIMEOUT
    assert by["garbage"].end_reason is EndReason.ENV_GARBAGE
    assert by["garbage_reset"].end_reason is EndReason.ENV_GARBAGE
    assert "no such dataset" in by["broken_ctor"].error
    for name in ("raise", "hang", "garbage", "garbage_reset", "broken_ctor"):
        assert by[name].status is TrajectoryStatus.FAILED
    m = batch.metrics
    assert (m.num_trajectories, m.num_ok, m.num_failed) == (14, 9, 5)
    assert m.failures == {"env_error": 2, "env_timeout": 1, "env_garbage": 2}
    assert engine.max_in_flight <= 2
    json.dumps(m.to_dict())


def test_engine_failures_are_contained():
    class FlakyEngine(ScriptedEngine):
        async def generate(self, request):
            if request.session.startswith("bad"):
                raise EngineError("engine unreachable")
            return await super().generate(request)

    turns = demo_assistant_turns(ArithmeticEnv(), 3)
    engine = FlakyEngine(lambda req, t: assistant_turn_ids(turns[t], TOK))
    batch = run(
        AgentLoop(engine, TOK),
        [RolloutTask("arithmetic", 3, "bad"), RolloutTask("arithmetic", 3, "good")],
    )
    bad, good = batch.trajectories
    assert bad.end_reason is EndReason.ENGINE_ERROR and "unreachable" in bad.error
    assert good.ok and good.reward == 1.0
    assert batch.metrics.failures == {"engine_error": 1}


def test_reward_functions_and_env_specs(tmp_path):
    class Bonus:
        name = "bonus"

        async def __call__(self, inp):
            assert inp.task["target"] == "11" and inp.turns[-1] == "11"
            return 2.0

    class Broken:
        name = "broken"

        async def __call__(self, inp):
            raise ConnectionError("reward service down")

    spec_file = tmp_path / "env.yaml"
    spec_file.write_text(
        "name: megatron_earl.envs.arithmetic:ArithmeticEnv\nkwargs: {difficulty: 2}\n"
    )
    turns = demo_assistant_turns(ArithmeticEnv(), 3)
    loop = AgentLoop(turns_engine(turns), TOK, reward_fns=[WeightedReward(Bonus(), 0.25)])
    (t,) = run(loop, [RolloutTask(str(spec_file), 3)]).trajectories
    assert t.rewards == {"outcome": 1.0, "bonus": 2.0} and t.reward == 1.5
    loop = AgentLoop(turns_engine(turns), TOK, reward_fns=[WeightedReward(Broken())])
    (t,) = run(loop, [RolloutTask("arithmetic", 3)]).trajectories
    assert t.end_reason is EndReason.REWARD_ERROR and "reward service down" in t.error
    with pytest.raises(KeyError, match="unknown environment 'nope'; registered"):
        ENVS.build("nope")


class TokenEnv(Environment):
    """Prompt and observations given as token ids (used verbatim)."""

    async def reset(self, seed: int) -> ResetResult:
        return ResetResult([2, *TOK.encode("user\nx"), 3, *TOK.generation_prompt()])

    async def step(self, action: Action) -> StepResult:
        if action.text == "again":
            return StepResult([40, 41, 42], role="ignored-for-ids")
        return StepResult(None, 0.5, True)


def test_token_observations_are_appended_verbatim():
    (t,) = run(
        AgentLoop(turns_engine(["again", "stop"]), TOK), [RolloutTask(TokenEnv, 0)]
    ).trajectories
    first, second = assistant_turn_ids("again", TOK), assistant_turn_ids("stop", TOK)
    obs = [*TOK.end_of_turn_suffix(), 40, 41, 42, *TOK.generation_prompt()]
    assert t.prompt_ids == [2, *TOK.encode("user\nx"), 3, *TOK.generation_prompt()]
    assert t.response_ids == first + obs + second
    assert t.loss_mask == [1] * len(first) + [0] * len(obs) + [1] * len(second)
    assert t.reward == 0.5 and t.end_reason is EndReason.DONE
    check_alignment(t)


class ExitingEnv(ArithmeticEnv):
    async def step(self, action: Action) -> StepResult:
        raise SystemExit(3)


class InterruptedResetEnv(ArithmeticEnv):
    async def reset(self, seed: int):
        raise KeyboardInterrupt


class DeafEnv(ArithmeticEnv):
    """A step that swallows every cancellation (``asyncio.wait_for`` would wait for it forever)."""

    async def step(self, action: Action) -> StepResult:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue


def test_base_exceptions_and_deaf_envs_fail_only_their_trajectory():
    """SystemExit from a step and KeyboardInterrupt from a reset fail their trajectory (the
    process goes on); a step that ignores cancellation is abandoned at env_timeout_s; a reward
    function that hangs past reward_timeout_s or raises SystemExit fails its trajectory; the
    healthy trajectory of the same batch finishes, and the batch returns in bounded time."""

    class HangingReward:
        name = "hang"

        async def __call__(self, inp) -> float:
            await asyncio.sleep(3600)
            return 0.0

    class ExitingReward:
        name = "exit"

        async def __call__(self, inp) -> float:
            raise SystemExit(4)

    turns = demo_assistant_turns(ArithmeticEnv(), 3)
    config = AgentLoopConfig(env_timeout_s=0.5, reward_timeout_s=0.5, max_turns=4)
    start = time.monotonic()
    tasks = [RolloutTask(env, 3) for env in (ExitingEnv, InterruptedResetEnv, DeafEnv)]
    batch = run(AgentLoop(turns_engine(turns), TOK, config), [*tasks, RolloutTask("arithmetic", 3)])
    reasons = [(t.status.value, t.end_reason.value) for t in batch.trajectories]
    assert reasons == [
        ("failed", "env_error"),
        ("failed", "env_error"),
        ("failed", "env_timeout"),
        ("ok", "done"),
    ]
    assert "SystemExit" in batch.trajectories[0].error
    assert "KeyboardInterrupt" in batch.trajectories[1].error
    cases = ((HangingReward(), "ran past reward_timeout_s=0.5"), (ExitingReward(), "SystemExit"))
    for reward, fragment in cases:
        loop = AgentLoop(turns_engine(turns), TOK, config, [WeightedReward(reward, 1.0)])
        (t,) = run(loop, [RolloutTask("arithmetic", 3)]).trajectories
        assert (t.status.value, t.end_reason.value) == ("failed", "reward_error")
        assert fragment in t.error
    assert time.monotonic() - start < 30
    with pytest.raises(ValueError, match="reward_timeout_s must be > 0 and finite"):
        AgentLoopConfig(reward_timeout_s=float("inf"))


class NoneInfoEnv(ArithmeticEnv):
    """The hostile tester's environment: ``reset`` returns ``info=None``."""

    async def reset(self, seed: int) -> ResetResult:
        return ResetResult((await super().reset(seed)).prompt, None)


class GymStepEnv(ArithmeticEnv):
    """A gym-style ``step``: an (observation, reward, done, info) tuple."""

    async def step(self, action: Action):
        return "ok", 0.0, False, {}


class EmptyPromptEnv(ArithmeticEnv):
    """``reset`` returns an empty prompt (was an engine error: "input_ids is empty")."""

    async def reset(self, seed: int) -> ResetResult:
        return ResetResult([], {})


class NumberObservationEnv(ArithmeticEnv):
    async def step(self, action: Action) -> StepResult:
        return StepResult(42)


def test_badly_shaped_env_returns_fail_only_their_trajectory():
    """A hostile tester's environment whose ``reset`` returned ``info=None`` ended the whole batch
    (``TypeError: 'NoneType' object is not iterable`` in the agent loop). That one and the other
    badly shaped returns the loop consumes (a gym tuple from ``step``, a number as observation, a
    factory that returns None) fail only their trajectory (env_garbage) with an error naming the
    environment, the method and the value; the healthy trajectories of the batch finish."""
    cases = {
        "none_info": (NoneInfoEnv, "NoneInfoEnv.reset returned info=None, expected a dict"),
        "gym_tuple": (
            GymStepEnv,
            "GymStepEnv.step returned ('ok', 0.0, False, {}), expected a StepResult",
        ),
        "number_observation": (
            NumberObservationEnv,
            "NumberObservationEnv.step returned observation=42, expected text or token ids",
        ),
        "no_env": (lambda: None, "the environment factory returned None, expected an Environment"),
        "empty_prompt": (EmptyPromptEnv, "EmptyPromptEnv.reset returned prompt=[], expected chat"),
    }
    tasks = [RolloutTask(env, 3, name) for name, (env, _) in cases.items()]
    tasks += [RolloutTask("arithmetic", 3, f"healthy{i}") for i in range(2)]
    turns = demo_assistant_turns(ArithmeticEnv(), 3)
    batch = run(AgentLoop(turns_engine(turns), TOK), tasks)
    by = {t.group_id: t for t in batch.trajectories}
    for name, (_, error) in cases.items():
        assert (by[name].status, by[name].end_reason) == (
            TrajectoryStatus.FAILED,
            EndReason.ENV_GARBAGE,
        ), name
        assert error in by[name].error, by[name].error
    assert all(by[f"healthy{i}"].ok and by[f"healthy{i}"].reward == 1.0 for i in range(2))
    assert batch.metrics.failures == {"env_garbage": 5}


class SyncEnv(Environment):
    """A synchronous environment (plain ``def`` methods): one turn, reward 1; ``step`` sleeps
    ``sleep_s`` on the calling thread when the seed is 0."""

    def __init__(self, sleep_s: float = 30.0) -> None:
        self.sleep_s, self.seed = sleep_s, 0

    def reset(self, seed: int) -> ResetResult:
        self.seed = seed
        return ResetResult([{"role": "user", "content": f"say hi {seed}"}], {"seed": seed})

    def step(self, action: Action) -> StepResult:
        if self.seed == 0:
            time.sleep(self.sleep_s)
        return StepResult(None, reward=1.0, done=True)

    def close(self) -> None:
        pass


def test_a_blocking_sync_env_or_reward_does_not_stall_the_other_trajectories():
    """Issue 22 item 6: synchronous env methods and reward functions run on worker threads under
    their timeouts. One env's ``step`` sleeps 30 s on its thread: only that trajectory fails
    (env_timeout at env_timeout_s=1); the other sync-env trajectories and an async env's finish
    in well under the timeout. Then a sync reward function that sleeps for seed 5 only: that
    trajectory fails (reward_error), the others are scored. Before, a sync method's sleep ran
    on the event loop (every trajectory waited for it) and its plain return value failed the
    trajectory as not awaitable."""
    turns = ["hi <tool_call>"]  # any one turn: SyncEnv's step ends the episode
    config = AgentLoopConfig(env_timeout_s=1.0, reward_timeout_s=1.0, max_turns=2)
    start = time.monotonic()
    tasks = [RolloutTask(SyncEnv, s) for s in range(4)]
    arith = demo_assistant_turns(ArithmeticEnv(), 3)
    batch = run(AgentLoop(turns_engine(turns), TOK, config), tasks)
    elapsed = time.monotonic() - start
    got = [(t.status.value, t.end_reason.value) for t in batch.trajectories]
    assert got == [("failed", "env_timeout")] + [("ok", "done")] * 3
    assert "step ran past env_timeout_s=1" in batch.trajectories[0].error
    assert all(t.wall_s < 0.5 for t in batch.trajectories[1:]), [
        t.wall_s for t in batch.trajectories
    ]
    assert elapsed < 5
    (t,) = run(
        AgentLoop(turns_engine(arith), TOK, config), [RolloutTask("arithmetic", 3)]
    ).trajectories
    assert t.ok and t.reward == 1.0  # async envs unchanged

    class SyncReward:
        name = "slow_for_seed_5"

        def __call__(self, inp) -> float:
            if inp.seed == 5:
                time.sleep(30)
            return 0.5

    loop = AgentLoop(turns_engine(turns), TOK, config, [WeightedReward(SyncReward(), 1.0)])
    start = time.monotonic()
    batch = run(loop, [RolloutTask(lambda: SyncEnv(0.0), s) for s in (4, 5, 6)])
    got = [(t.status.value, t.end_reason.value, t.reward) for t in batch.trajectories]
    assert got == [("ok", "done", 1.5), ("failed", "reward_error", 0.0), ("ok", "done", 1.5)]
    assert "ran past reward_timeout_s=1" in batch.trajectories[1].error
    assert max(batch.trajectories[i].wall_s for i in (0, 2)) < 0.5
    assert time.monotonic() - start < 5


class CancelledCtorEnv(ArithmeticEnv):
    def __init__(self) -> None:
        raise asyncio.CancelledError("no environment today")


class CancelledResetEnv(ArithmeticEnv):
    async def reset(self, seed: int) -> ResetResult:
        raise asyncio.CancelledError("reset gave up")


class CancelledStepEnv(ArithmeticEnv):
    async def step(self, action: Action) -> StepResult:
        raise asyncio.CancelledError


class SelfCancellingStepEnv(ArithmeticEnv):
    """A step that cancels the task it runs in."""

    async def step(self, action: Action) -> StepResult:
        asyncio.current_task().cancel()
        await asyncio.sleep(0)
        raise AssertionError("unreachable")


class SyncCancelledStepEnv(SyncEnv):
    def step(self, action: Action) -> StepResult:
        raise asyncio.CancelledError("from a worker thread")


def test_cancelled_error_of_an_env_is_contained_but_cancelling_the_batch_cancels_it():
    """``asyncio.CancelledError`` raised by an environment's own code (constructor, reset, step, a
    plain-def step on its worker thread, a step that cancels its own task) fails only its trajectory
    (env_error) and the batch completes; before, it ended the batch. A cancellation by the caller,
    arriving while a trajectory is inside an environment call, still cancels that call and the
    batch, or the one trajectory when the caller runs it alone (the asynchronous producer cancels
    trajectories that way)."""
    turns = demo_assistant_turns(ArithmeticEnv(), 3)
    envs = (
        CancelledCtorEnv,
        CancelledResetEnv,
        CancelledStepEnv,
        SelfCancellingStepEnv,
        SyncCancelledStepEnv,
    )
    config = AgentLoopConfig(env_timeout_s=5.0)
    tasks = [RolloutTask(env, 3, env.__name__) for env in envs]
    batch = run(AgentLoop(turns_engine(turns), TOK, config), [*tasks, RolloutTask("arithmetic", 3)])
    *failed, healthy = batch.trajectories
    for traj in failed:
        assert (traj.status, traj.end_reason) == (TrajectoryStatus.FAILED, EndReason.ENV_ERROR)
        assert "CancelledError" in traj.error, traj.error
    assert failed[0].error == "creating the environment raised CancelledError: no environment today"
    assert failed[1].error == (
        "CancelledResetEnv.reset raised UserCodeExit: CancelledError(reset gave up)"
    )
    assert failed[2].error.startswith("CancelledStepEnv.step raised UserCodeExit: CancelledError")
    assert failed[4].error == (
        "SyncCancelledStepEnv.step raised UserCodeExit: CancelledError(from a worker thread)"
    )
    assert healthy.ok and healthy.reward == 1.0
    assert batch.metrics.failures == {"env_error": 5}

    step_cancelled: list[bool] = []

    class HangingStepEnv(ArithmeticEnv):
        async def step(self, action: Action) -> StepResult:
            step_cancelled.append(False)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                step_cancelled[-1] = True
                raise
            raise AssertionError("unreachable")

    async def cancel_mid_step(work: Callable[[AgentLoop], Awaitable]) -> asyncio.Task:
        step_cancelled.clear()
        running = asyncio.create_task(work(AgentLoop(turns_engine(turns), TOK, config)))
        while not step_cancelled:
            await asyncio.sleep(0.01)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await asyncio.sleep(0.05)  # the abandoned step gets its cancellation
        return running

    tasks = [RolloutTask(HangingStepEnv, 3), RolloutTask(CancelledStepEnv, 3)]
    works = (
        lambda loop: loop.run_batch(tasks),
        lambda loop: loop.run_trajectory(HangingStepEnv, 3, "alone"),
    )
    for work in works:
        start = time.monotonic()
        running = asyncio.run(cancel_mid_step(work))
        assert running.cancelled() and step_cancelled == [True]
        assert time.monotonic() - start < 3  # not after env_timeout_s
