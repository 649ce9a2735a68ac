"""``bench peer``'s settings and summaries: both sides are built from one ``PeerSettings`` and
agree on every shared setting (our measured run's config reads back to the same settings; TRL's
``GRPOConfig`` holds the same values); settings TRL cannot match are refused by name; the steady
state drops the warm-up step and counts completion tokens only.

Run: python -m pytest -q -p no:warnings tests/unit/test_peer_workload.py
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_earl.bench.peer import (
    COMPILE_KEY,
    OURS_PHASES,
    TRL_PHASES,
    Pair,
    RunSummary,
    main,
    ours_summary,
    report,
    steady_state,
    trl_summary,
)
from megatron_earl.bench.peer_workload import (
    WORKLOADS,
    PeerSettings,
    ours_overrides,
    trl_arguments,
    workload_config,
)
from megatron_earl.config.loader import load_config

DEMO = "configs/demo_cpu.yaml"


def _settings(name: str, overrides=()) -> PeerSettings:
    workload = WORKLOADS[name]
    return PeerSettings.from_run(workload_config(DEMO, workload, list(overrides)), workload)


def test_workloads_match_the_demo_settings():
    single, multi = _settings("single-turn"), _settings("multi-turn-tool")
    assert (single.max_turns, single.sft_steps) == (1, 0)
    assert (multi.max_turns, multi.sft_steps) == (3, 150)
    for s in (single, multi):
        assert (s.prompts_per_step, s.samples_per_prompt, s.max_new_tokens) == (8, 8, 48)
        assert (s.lr, s.clip_grad, s.clip_eps, s.kl_coef) == (3e-4, 1.0, (0.2, 0.28), 0.0)
        assert (s.temperature, s.top_p, s.trl_loss_type) == (1.0, 1.0, "dapo")
        assert s.env == {"name": "arithmetic", "kwargs": {"difficulty": 2}}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_our_measured_run_has_the_same_settings(name):
    workload = WORKLOADS[name]
    overrides = ["seed=7", "train.lr=1e-4"]
    expected = _settings(name, overrides)
    run = load_config(
        DEMO, [*overrides, *ours_overrides(workload, init="w", steps=3, out="o", name="n")]
    )
    got = PeerSettings.from_run(run, workload)
    # the warm start is in the start weights: the measured run itself takes no SFT step
    assert dataclasses.replace(got, sft_steps=expected.sft_steps) == expected
    assert (run.sft.steps, run.checkpoint.load, run.steps, run.eval.num_prompts) == (0, "w", 3, 0)
    assert not run.checkpoint.resume


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_trl_config_has_the_same_settings(name):
    trl = pytest.importorskip("trl")
    s = _settings(name, ["seed=7"])
    args = trl.GRPOConfig(**trl_arguments(s, output_dir="unused", steps=3))
    assert args.generation_batch_size == s.prompts_per_step * s.samples_per_prompt
    assert args.num_generations == s.samples_per_prompt
    assert (args.max_completion_length, args.temperature, args.top_p, args.top_k) == (48, 1, 1, 0)
    assert (args.learning_rate, args.lr_scheduler_type, args.max_grad_norm) == (3e-4, "constant", 1)
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == (
        0.9,
        0.999,
        1e-8,
        0.0,
    )
    assert (args.epsilon, args.epsilon_high, args.beta, args.loss_type) == (0.2, 0.28, 0, "dapo")
    assert (args.num_iterations, args.steps_per_generation, args.seed) == (1, 1, 7)
    assert not args.shuffle_dataset and not args.gradient_checkpointing and args.use_cpu


def test_settings_round_trip_through_json():
    s = _settings("multi-turn-tool")
    assert PeerSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_unmatchable_settings_are_named():
    with pytest.raises(ValueError, match=r"batch.num_mini_batches=2.*top_k=5"):
        _settings("single-turn", ["batch.num_mini_batches=2", "rollout.sampling.top_k=5"])
    with pytest.raises(ValueError, match=r"train\.advantage='rloo'"):
        _settings("single-turn", ["train.advantage=rloo"])


def test_trl_batch_must_split_over_processes():
    with pytest.raises(ValueError, match="64 samples per step do not split over 3"):
        trl_arguments(_settings("single-turn"), output_dir="x", steps=2, num_processes=3)


def test_steady_state_drops_the_warm_up_step():
    steps = [
        {"time/step": 10.0, "time/a": 9.0},
        {"time/step": 2.0, "time/a": 1.0},
        {"time/step": 4.0, "time/a": 3.0},
    ]
    got = steady_state(steps, [999.0, 100.0, 200.0], ("a",), [9.0, 300.0, 500.0], [1.0, 2.0, 4.0])
    assert (got.s_per_step, got.tokens_per_s, got.tokens_per_step) == (3.0, 50.0, 150.0)
    assert got.phases == {"a": 2.0}
    assert (got.forward_per_step, got.real_per_step) == (400.0, 3.0)
    with pytest.raises(ValueError, match="need >= 2 steps"):
        steady_state(steps[:1], [1.0], ("a",), [1.0], [1.0])
    with pytest.raises(ValueError, match=r"3 steps and \[3, 2, 3\] counts"):
        steady_state(steps, [1.0] * 3, ("a",), [1.0] * 2, [1.0] * 3)


def test_ours_counts_trainable_tokens(tmp_path):
    rows = [
        {
            "time/step": t,
            "time/rollout": t / 2,
            "time/experience": t / 4,
            "time/train": t / 4,
            "response_len/mean": 30.0,
            "rollout/trajectories": 64.0,
            "rollout/tokens": 5000.0,  # prompts and tool outputs too: not counted
            "train/num_shared_tokens": shared,
        }
        for t, shared in ((9.0, 0.0), (4.0, 600.0), (4.0, 800.0))
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = ours_summary(path)
    assert (got.s_per_step, got.tokens_per_step, got.tokens_per_s) == (4.0, 1920.0, 480.0)
    assert got.phases == {"rollout": 2.0, "experience": 1.0, "train": 1.0}
    # the train forward computes every trajectory token but those prefix sharing skips
    assert (got.forward_per_step, got.real_per_step) == (4300.0, 5000.0)


def test_trl_forward_positions_are_its_padded_batch():
    records = [
        {
            "time/step": t,
            "time/generate": 1.0,
            "time/update": t - 1.0,
            "completion_tokens": 90.0,
            "forward_positions": 4.0 * width,
            "real_tokens": 120.0,
        }
        for t, width in ((5.0, 70), (2.0, 40), (3.0, 60))
    ]
    got = trl_summary({"steps": records})
    assert (got.forward_per_step, got.real_per_step) == (200.0, 120.0)


def test_report_compares_each_pair_with_its_best_trl_run():
    def run(tokens_per_s: float) -> RunSummary:
        phases = dict.fromkeys((*OURS_PHASES, *TRL_PHASES), 0.5)
        return RunSummary(1.0, tokens_per_s, tokens_per_s, phases, 700.0, 600.0)

    pairs = [
        Pair(run(300.0), {1: run(100.0), 2: run(50.0)}),  # 3.0 against 1 process
        Pair(run(100.0), {1: run(50.0), 2: run(100.0)}),  # 1.0 against 2 processes
        Pair(run(400.0), {1: run(200.0), 2: run(100.0)}),  # 2.0 against 1 process
    ]
    assert [p.best_trl for p in pairs] == [1, 2, 1]
    info = dict(params=10, nproc=2, ours_threads=1, trl_threads={1: 2, 2: 1})
    info.update(ours_decode="compiled", trl_generation="stock", steps=3)
    lines = report("single-turn", _settings("single-turn"), pairs, info)
    assert "median of per-pair ratios 2.00" in lines[-2]
    assert "1p x2, 2p x1" in lines[-2]
    assert "ours median: 1.00 s/step, 300 tokens/s" in lines[4]
    pairs[0].trl[1] = dataclasses.replace(pairs[0].trl[1], forward_per_step=900.0)
    line = report("single-turn", _settings("single-turn"), pairs, info)[5]  # median of 3
    assert line.endswith("; update forward over 700 positions/step (600 real tokens)"), line
    assert "TRL 1p median: 1.00 s/step, 100 tokens/s" in lines[5]
    assert "TRL 2p median: 1.00 s/step, 100 tokens/s" in lines[6]
    assert "1p x 2, 2p x 1" in lines[-1] and "decode step compiled" in lines[-1]


def test_our_decode_step_is_set_by_the_flag_only(capsys):
    """``--decode`` decides ``rollout.embedded.compile_decode`` on our side; the override next
    to it would be silently replaced, so it is refused before anything runs."""
    with pytest.raises(SystemExit):
        main([f"{COMPILE_KEY}=false", "--work-dir", "/nonexistent/never-made"])
    assert "--decode compiled|eager" in capsys.readouterr().err
