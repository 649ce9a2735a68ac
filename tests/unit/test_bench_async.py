"""The paced benchmark's arithmetic (``orchestration.bench_async``): steady-state figures of a run,
the simulator's inputs from a measured synchronous run, the engines' pacing counters between two
reads, and its bad arguments."""

from __future__ import annotations

import pytest

from megatron_earl.config.loader import load_config
from megatron_earl.envs.longtail import LongTailEnv
from megatron_earl.orchestration import bench_async as bench


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
    records = [_record(2.0, 1.0, 384, turns_mean=2.0), _record(3.0, 1.0, 384, turns_mean=2.0)]
    pacing = {"mean_prefill_ms": 12.0}
    inputs = bench.sim_config(config, records, pacing, 30.0, 2, 64, skip=0)
    per_turn = 768 / (2.0 * 64 * 2)  # generated tokens / model turns
    env = LongTailEnv(**config.env.kwargs)
    turns = [len(env.task(g)) for g in range(8 * 2)]
    assert inputs["lengths"] == [max(1, round(t * per_turn)) for t in turns for _ in range(8)]
    assert inputs["decode_s_per_token"] == 0.03 and inputs["prefill_s"] == 0.012
    assert inputs["train_s_per_token"] == pytest.approx((0.9 + 1.9 + 0.2) / 768)
    assert inputs["push_s"] == pytest.approx(0.2) and inputs["num_engines"] == 2


def test_pacing_counters_between_two_reads():
    def info(steps, overruns, prefills, mean):
        return {"pacing": {"decode_steps": steps, "overruns": overruns,
                           "prefill_steps": prefills, "mean_prefill_ms": mean}}  # fmt: skip

    before = [info(10, 1, 4, 10.0), info(0, 0, 0, 0.0)]
    after = [info(30, 1, 8, 15.0), info(5, 2, 2, 10.0)]
    got = bench._pacing(before, after)
    assert got["decode_steps"] == 25 and got["overruns"] == 2 and got["prefill_steps"] == 6
    assert got["mean_prefill_ms"] == pytest.approx((8 * 15 - 40 + 20) / 6)


@pytest.mark.parametrize(
    "argv", [["--staleness", "one"], ["--steps", "1", "--skip", "1"], ["--pace-ms", "0"]]
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as err:
        bench.main(argv)
    assert err.value.code == 2
