"""The ``longtail`` environment: seeded long-tailed turn counts (lognormal and Pareto, the
distribution reported), episodes that end after exactly that many answers with reward = the
fraction right, a demonstration that the episode scores 1, and bad settings named."""

from __future__ import annotations

import asyncio

import pytest

from megatron_earl.envs import ENVS, Action, LongTailEnv


def _play(env: LongTailEnv, seed: int, answer) -> tuple[float, int, dict]:
    async def body():
        first = await env.reset(seed)
        total, turns, text = 0.0, 0, first.prompt[0]["content"]
        while True:
            result = await env.step(Action(answer(text), ()))
            total, turns = total + result.reward, turns + 1
            if result.done:
                return total, turns, first.info
            text = result.observation

    return asyncio.run(body())


@pytest.mark.parametrize("spec", [{}, {"distribution": "pareto", "scale": 1, "shape": 1.2}])
def test_turn_counts_are_seeded_and_long_tailed(spec):
    env = ENVS.build({"name": "longtail", "kwargs": {"max_turns": 64, **spec}})
    assert [len(env.task(s)) for s in range(50)] == [len(env.task(s)) for s in range(50)]
    dist = env.turn_distribution(num_tasks=5000)
    assert dist["p99"] >= 5 * dist["p50"] and dist["max"] <= 64
    assert dist["distribution"] == spec.get("distribution", "lognormal")


def test_episode_length_and_reward():
    env = LongTailEnv(scale=3, shape=1.0, max_turns=12)
    seed = next(s for s in range(100) if len(env.task(s)) >= 3)
    n = len(env.task(seed))
    right, turns, info = _play(env, seed, lambda text: text.split()[-1])
    assert (right, turns, info["turns"]) == (pytest.approx(1.0), n, n)
    wrong, turns, _ = _play(env, seed, lambda text: "x")
    assert (wrong, turns) == (0.0, n)


def test_digits_fix_the_answer_length():
    env = LongTailEnv(digits=6)
    answers = [m["content"] for m in env.demonstration(3) if m["role"] == "assistant"]
    assert all(len(a) == 6 and a.isdigit() for a in answers)
    assert env.turn_distribution(100)["tokens_per_turn"] == 7
    right, turns, _ = _play(env, 3, lambda text: text.split()[-1])
    assert right == pytest.approx(1.0) and turns == len(answers)


def test_demonstration_is_the_right_episode():
    env = LongTailEnv(scale=3, shape=1.0, max_turns=12)
    for seed in range(20):
        demo = env.demonstration(seed)
        answers = [m["content"] for m in demo if m["role"] == "assistant"]
        assert answers == [f"{x:02d}" for x in env.task(seed)]
        assert [m["role"] for m in demo[:2]] == ["user", "assistant"]


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"distribution": "zipf"},
            "distribution must be one of ('lognormal', 'pareto'), got 'zipf'",
        ),
        ({"shape": 0}, "shape=0"),
        ({"max_turns": 0}, "max_turns=0"),
        ({"digits": 13}, "digits=13"),
    ],
)
def test_bad_settings_are_named(kw, message):
    with pytest.raises(ValueError) as err:
        LongTailEnv(**kw)
    assert message in str(err.value)
