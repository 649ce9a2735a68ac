"""The pipeline simulator (``bench.pipeline_sim``) on hand-computable cases, the
async-vs-sync relations it must show, its token accounting and its input errors."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_earl.bench.pipeline_sim import LengthDist, SimConfig, simulate

D = 0.01  # s per decode step
ONE_ENGINE = SimConfig(
    num_engines=1,
    slots_per_engine=8,
    decode_s_per_token=D,
    lengths=LengthDist.fixed(100),
    group_size=2,
    prompts_per_step=2,
    train_s_fixed=0.5,
    train_s_per_token=0.001,
    push_s=0.2,
    num_steps=3,
)
LONG_TAIL = SimConfig(
    num_engines=4,
    slots_per_engine=16,
    decode_s_per_token=0.02,
    lengths=LengthDist.lognormal(median=200, sigma=1.0, max_tokens=4000),
    tokens_per_turn=64,
    env_step_s=0.5,
    group_size=4,
    prompts_per_step=8,
    train_s_per_token=2e-4,
    push_s=1.0,
    num_steps=20,
    seed=3,
)


def _with(config: SimConfig, **kw) -> SimConfig:
    return dataclasses.replace(config, **kw)


def test_sync_step_is_slowest_trajectory_plus_train_plus_push():
    out = simulate(ONE_ENGINE).to_dict()
    rollout, train, push = 100 * D, 0.5 + 0.001 * 4 * 100, 0.2
    step = rollout + train + push
    assert out["s_per_step"] == pytest.approx(step, rel=1e-12)
    assert out["duration_s"] == pytest.approx(3 * step, rel=1e-12)
    assert out["trainer_idle_fraction"] == pytest.approx(rollout / step)
    assert out["trained_trajectories"] == 12 and out["trained_tokens"] == 1200
    assert out["staleness_trajectories"] == {0: 12} and out["staleness_tokens"] == {0: 1200}


@pytest.mark.parametrize(
    "change, rollout_s",
    [
        ({"slots_per_engine": 2}, 2 * 100 * D),  # 4 trajectories, 2 at a time
        ({"batch_slope": 0.5}, 100 * D * (1 + 0.5 * 3)),  # 4 running: step x 2.5
        ({"tokens_per_turn": 40, "env_step_s": 0.3}, 100 * D + 2 * 0.3),  # turns 40, 40, 20
        ({"num_engines": 2, "slots_per_engine": 1}, 2 * 100 * D),  # 2 per engine, one at a time
        ({"prefill_s": 0.5}, 0.5 + 99 * D),  # one prefill of all 4 gives the first token
        ({"prefill_s": 0.5, "tokens_per_turn": 40, "env_step_s": 0.3}, 1.5 + 97 * D + 0.6),
        ({"prefill_s": 0.5, "slots_per_engine": 2}, 2 * (0.5 + 99 * D)),
    ],
)
def test_sync_rollout_time_by_hand(change, rollout_s):
    out = simulate(_with(ONE_ENGINE, **change)).to_dict()
    assert out["s_per_step"] == pytest.approx(rollout_s + 0.5 + 0.4 + 0.2, rel=1e-12)


def test_async_overlaps_rollout_with_training_by_hand():
    # B = G = 1, k = 1: two groups start at once, both done at 1 s; afterwards each new group
    # (1 s of decoding) is ready before the trainer (1.5 s train + 0.5 s push) is free again.
    config = _with(
        ONE_ENGINE,
        group_size=1,
        prompts_per_step=1,
        train_s_fixed=1.5,
        train_s_per_token=0.0,
        push_s=0.5,
        num_steps=4,
    )
    sync = simulate(config).to_dict()
    assert sync["duration_s"] == pytest.approx(4 * 3.0)
    out = simulate(_with(config, mode="async", max_staleness=1)).to_dict()
    assert out["duration_s"] == pytest.approx(1.0 + 4 * 2.0)
    assert out["trainer_idle_fraction"] == pytest.approx(1.0 / 9.0)
    assert out["staleness_trajectories"] == {0: 1, 1: 3}
    assert out["discarded_trajectories"] == 0


@pytest.mark.parametrize("partial", ["continue", "restart"])
@pytest.mark.parametrize("prefill_s", [None, 0.05])
def test_async_with_zero_staleness_is_the_sync_schedule(partial, prefill_s):
    config = _with(LONG_TAIL, prefill_s=prefill_s)
    sync = simulate(config).to_dict()
    out = simulate(_with(config, mode="async", max_staleness=0, partial_rollout=partial))
    out = out.to_dict()
    for key in ("duration_s", "trainer_idle_fraction", "engine_utilization"):
        assert out[key] == pytest.approx(sync[key], rel=1e-9), key
    for key in ("trained_tokens", "generated_tokens", "staleness_tokens", "wasted_tokens"):
        assert out[key] == sync[key], key
    assert out["discarded_trajectories"] == 0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_async_beats_sync_on_a_long_tail_within_the_bound(k):
    sync = simulate(LONG_TAIL).to_dict()
    out = simulate(_with(LONG_TAIL, mode="async", max_staleness=k)).to_dict()
    assert out["trajectories_per_s"] > 1.5 * sync["trajectories_per_s"]
    assert out["trainer_idle_fraction"] < sync["trainer_idle_fraction"]
    assert max(out["staleness_trajectories"]) <= k
    assert max(out["staleness_tokens"]) <= k
    assert max(out["staleness_trajectories"]) >= 1  # it did train off-policy
    assert out["wasted_tokens"] == 0


def test_engine_pause_shorter_than_the_trainers_publish_by_hand():
    """Relay weight service: the trainer blocked ``push_s``, the engines paused only
    ``engine_pause_s``. Sync on one engine: the next step's rollout starts at the publish's end
    either way, so the step is unchanged; with the engines' pause equal to the push the
    schedule is exactly the direct push's."""
    assert (
        simulate(_with(ONE_ENGINE, engine_pause_s=0.2)).to_dict() == simulate(ONE_ENGINE).to_dict()
    )
    out = simulate(_with(ONE_ENGINE, engine_pause_s=0.05)).to_dict()
    assert out["s_per_step"] == pytest.approx(100 * D + 0.5 + 0.4 + 0.2, rel=1e-12)


def test_async_gains_when_the_engines_pause_less_than_the_trainer_publishes():
    direct = simulate(_with(LONG_TAIL, mode="async", max_staleness=1, push_s=4.0)).to_dict()
    relay = simulate(
        _with(LONG_TAIL, mode="async", max_staleness=1, push_s=4.0, engine_pause_s=0.5)
    ).to_dict()
    assert relay["trajectories_per_s"] > direct["trajectories_per_s"]
    assert max(relay["staleness_trajectories"]) <= 1


def test_restart_wastes_tokens_that_continue_keeps():
    cont = simulate(_with(LONG_TAIL, mode="async", max_staleness=1)).to_dict()
    restart = simulate(
        _with(LONG_TAIL, mode="async", max_staleness=1, partial_rollout="restart")
    ).to_dict()
    assert cont["wasted_tokens"] == 0 and cont["restarted_trajectories"] == 0
    assert restart["wasted_tokens"] > 0 and restart["restarted_trajectories"] > 0
    assert restart["trajectories_per_s"] < cont["trajectories_per_s"]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"mode": "async", "max_staleness": 1},
        {"mode": "async", "max_staleness": 2, "partial_rollout": "restart"},
        {"mode": "async", "max_staleness": 1, "prefill_s": 0.05},
        {"mode": "async", "max_staleness": 1, "prefill_s": 0.05, "partial_rollout": "restart"},
    ],
)
def test_every_token_is_accounted_for_and_runs_are_deterministic(kw):
    config = _with(LONG_TAIL, **kw)
    out = simulate(config).to_dict()
    accounted = (
        out["trained_tokens"]
        + out["discarded_tokens"]
        + out["wasted_tokens"]
        + out["left_over_tokens"]
    )
    assert out["generated_tokens"] == accounted
    assert out["trained_trajectories"] == config.num_steps * 8 * 4
    assert sum(out["staleness_tokens"].values()) == out["trained_tokens"]
    assert simulate(config).to_dict() == out
    assert simulate(_with(config, seed=4)).to_dict() != out


def test_length_distributions():
    lognormal = LengthDist.lognormal(median=100, sigma=1.0, max_tokens=5000).describe()
    assert 90 <= lognormal["p50"] <= 110 and lognormal["p99_over_p50"] > 5
    pareto = LengthDist.pareto(minimum=50, alpha=1.5).describe()
    assert pareto["p50"] >= 50 and pareto["p99"] > 10 * pareto["p50"]
    assert LengthDist.empirical([3, 3, 3]).describe()["max"] == 3
    assert LengthDist.sequence([5, 1, 9]).describe()["p50"] == 5


def test_a_sequence_replays_a_run_in_order():
    # step 1: trajectories of 100 and 300 tokens; step 2: 200 and 50 (one engine, flat steps)
    config = _with(
        ONE_ENGINE,
        lengths=LengthDist.sequence([100, 300, 200, 50]),
        group_size=1,
        train_s_fixed=0.0,
        train_s_per_token=0.0,
        push_s=0.0,
        num_steps=2,
    )
    assert simulate(config).step_end_s == pytest.approx([300 * D, 500 * D])
    assert LengthDist.fixed(7).describe()["p99_over_p50"] == 1


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"max_staleness": -1}, "max_staleness=-1 (must be >= 0)"),
        ({"num_engines": 0}, "num_engines=0 (must be >= 1)"),
        ({"engine_pause_s": -1.0}, "engine_pause_s=-1.0 (must be >= 0 or None)"),
        ({"decode_s_per_token": 0.0}, "decode_s_per_token=0.0 (must be > 0)"),
        ({"mode": "asynch"}, "'asynch' is not a valid SimMode"),
        ({"partial_rollout": "drop"}, "'drop' is not a valid PartialRollout"),
    ],
)
def test_bad_config_names_the_value(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _with(ONE_ENGINE, **kw)


def test_bad_lengths_name_the_value():
    with pytest.raises(ValueError, match="lognormal lengths need shape > 0, got -1"):
        LengthDist.lognormal(median=100, sigma=-1)
    with pytest.raises(ValueError, match=r"empirical lengths need values >= 1, got \[0\]"):
        LengthDist.empirical([0])
