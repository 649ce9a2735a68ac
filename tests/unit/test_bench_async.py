"""The paced benchmark's arithmetic (``bench.async_rl``): steady-state figures of a run,
the simulator's inputs from a measured synchronous run, the engines' pacing counters between two
reads, and its bad arguments."""

from __future__ import annotations

import pytest

from megatron_earl.bench import async_rl as bench
from megatron_earl.config.loader import load_config
from megatron_earl.envs.longtail import LongTailEnv


def _record(step_s, rollout_s, tokens, turns_mean=2.0, trajectories=64, push=0.2):
    return {
        "time/step": step_s,
        "time/rollout": rollout_s,
        "time/experience": 0.1,
        "time/train": step_s - rollout_s - 0.1,
        "rollout/trajectories": trajectories,
        "rollout/turns_mean": turns_mean,
        "train/num_tokens": tokens,
        "sync/weight_push_s": push,
    }


def test_steady_figures_skip_the_warm_up():
    records = [_record(9.0, 8.0, 100), _record(2.0, 1.0, 400), _record(3.0, 1.0, 500)]
    got = bench.steady(records, skip=1)
    assert got["steps"] == 2 and got["s_per_step"] == 2.5
    assert got["trajectories_per_s"] == 128 / 5 and got["trained_tokens_per_s"] == 900 / 5
    assert got["trainer_idle_fraction"] == 2 / 5
    with pytest.raises(ValueError, match="3 steps, none left after skipping 3"):
        bench.steady(records, skip=3)


def test_sim_inputs_from_a_measured_sync_run():
    config = load_config(bench.CONFIG, ["steps=2"])
    records = [_record(2.0, 1.0, 384 * 7 // 2), _record(3.0, 1.0, 384 * 7 // 2)]
    for r in records:
        r["time_busy/experience"], r["time_busy/train"] = 0.1, 0.5
    inputs = bench.sim_inputs(config, records, 12.0, 40.0, 2, 64, skip=0)
    per_turn = 384 * 7 / (2.0 * 64 * 2)  # generated tokens / model turns = 10.5
    env = LongTailEnv(**config.env.kwargs)
    values = inputs["lengths"]["values"]
    assert inputs["lengths"]["kind"] == "sequence" and len(values) % 8 == 0
    assert values[:16] == [
        max(1, round(len(env.task(s)) * per_turn)) for s in (0, 1) for _ in range(8)
    ]
    assert inputs["decode_s_per_token"] == 0.04 and inputs["prefill_s"] == 0.012
    assert inputs["train_s_per_token"] == pytest.approx(1.2 / (384 * 7))  # busy time / tokens
    assert inputs["push_s"] == pytest.approx(0.2) and inputs["mode"] == "sync"
    asyn = bench.sim_inputs(config, records, 12.0, 40.0, 2, 64, skip=0, k=1)
    assert asyn["mode"] == "async" and asyn["max_staleness"] == 1
    assert asyn["train_s_per_token"] == pytest.approx(3.0 / (384 * 7))  # wall step - rollout


def test_turn_overhead_fit_reproduces_the_measured_sync_step():
    config = load_config(bench.CONFIG, ["steps=4"])
    records = [_record(2.0, 1.0, 300) for _ in range(4)]
    for r in records:
        r["time_busy/experience"], r["time_busy/train"] = 0.1, 0.5
    inputs = bench.sim_inputs(config, records, 10.0, 40.0, 2, 64, skip=1)
    base = bench.sim_s_per_step(inputs, 0.0, 1)
    overhead = bench.fit_turn_overhead(inputs, base + 0.5, 1)
    assert overhead > 0
    assert bench.sim_s_per_step(inputs, overhead, 1) == pytest.approx(base + 0.5, rel=1e-3)
    assert bench.fit_turn_overhead(inputs, base * 0.5, 1) == 0.0  # faster than any overhead


def test_pacing_counters_between_two_reads():
    def info(steps, overruns, prefills, mean):
        return {"pacing": {"decode_steps": steps, "overruns": overruns,
                           "prefill_steps": prefills, "mean_prefill_ms": mean}}  # fmt: skip

    before = [info(10, 1, 4, 10.0), info(0, 0, 0, 0.0)]
    after = [info(30, 1, 8, 15.0), info(5, 2, 2, 10.0)]
    got = bench.pacing_between(before, after)
    assert got["decode_steps"] == 25 and got["overruns"] == 2 and got["prefill_steps"] == 6
    assert got["mean_prefill_ms"] == pytest.approx((8 * 15 - 40 + 20) / 6)


@pytest.mark.parametrize(
    "argv", [["--staleness", "one"], ["--steps", "1", "--skip", "1"], ["--pace-ms", "0"]]
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as err:
        bench.main(argv)
    assert err.value.code == 2
