"""The memory model and selectors as the RL loop uses them: the workload comes from the
dispatcher's balancing and the train step's packing, the master copy's state is counted where it
lives, per-(phase, layout) fits recover their constants (pp2's analytic stage switch included),
a fitted negative constant never takes a prediction below the static state, and the loop's
selectors decide on exact lengths. Pure."""

from __future__ import annotations

import random

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.dispatch.balance import assign_samples
from megatron_earl.dispatch.spec import PlanConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.calibrate import CalibrationPoint, errors, fit
from megatron_earl.selector.memory import MemoryModel, MemorySettings, PhaseWorkload
from megatron_earl.training.microbatch import plan_micro_batches

TINY = ModelConfig(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=320
)
DP2, TP2, PP2 = ParallelLayout(dp=2), ParallelLayout(tp=2), ParallelLayout(pp=2)


def test_workload_is_the_loops_packing():
    rng = random.Random(0)
    lengths = [rng.randint(40, 250) for _ in range(16)]
    for dp in (1, 2):
        work = PhaseWorkload.for_lengths("train", lengths, token_budget=1024, dp=dp)
        table = dict(enumerate(lengths))
        replicas = assign_samples(table, table, dp, PlanConfig()) if dp > 1 else [list(table)]
        heaviest = max(([lengths[i] for i in r] for r in replicas), key=sum)
        bins = plan_micro_batches(heaviest, 1024)
        assert work.num_micro_batches == len(bins)
        assert work.tokens_per_micro_batch == max(sum(heaviest[i] for i in b) for b in bins)
    # 1347 tokens at dp1 are two balanced micro-batches, not a full budget plus the rest
    work = PhaseWorkload.for_lengths(
        "train", [90, 89, 88, 87] * 3 + [96, 87, 90, 89], dp=1, token_budget=1024
    )
    assert work.num_micro_batches == 2 and work.tokens_per_micro_batch < 760
    # more replicas than sequences: a replica holds one at most
    assert PhaseWorkload.for_lengths("train", [5, 9], dp=4).tokens_per_micro_batch == 9


def test_master_state_is_counted_where_it_lives():
    mem = MemoryModel(TINY, MemorySettings.cpu())
    work = PhaseWorkload.for_lengths("experience", [64] * 4, token_budget=256, dp=2)
    own = mem.peak("experience", DP2, work)  # master in dp2 itself
    split = mem.peak("experience", DP2, work, train_layout=TP2)
    weights_dp2, grads_dp2, optim_dp2 = mem.train_state(DP2)
    weights_tp2, grads_tp2, optim_tp2 = mem.train_state(TP2)
    assert own.weights == weights_dp2 and own.gradients == grads_dp2
    assert split.weights == weights_dp2 + weights_tp2  # its own copy + the master's weights
    assert split.gradients == grads_tp2 and split.optimizer == optim_tp2
    train = mem.peak("train", DP2, work, train_layout=TP2)  # train holds the master itself
    assert train.weights == weights_dp2 and train.optimizer == optim_dp2


def _points(truth: MemoryModel, layouts, phase="train"):
    out = []
    for layout in layouts:
        for n in (32, 64, 128, 256):
            lengths = tuple([n] * 16)
            work = PhaseWorkload.for_lengths(phase, lengths, token_budget=1024, dp=layout.dp)
            peak = truth.peak(phase, layout, work).total
            out.append(CalibrationPoint(phase, str(layout), lengths, 1024, int(peak), 0))
    return out


def test_per_layout_fit_recovers_its_constants():
    """Points from known per-layout constants (pp2's stage switch included): the per-layout fit
    returns them; one constant pair per phase cannot."""
    constants = {"train/" + str(DP2): (1.4, 3e5), "train/" + str(TP2): (0.8, 1e6)}
    constants["train/" + str(PP2)] = (1.1, -2e5)
    truth = MemoryModel(TINY, MemorySettings.cpu(layout_fit=constants))
    points = _points(truth, (DP2, TP2, PP2))
    base = MemoryModel(TINY, MemorySettings.cpu())
    fitted = fit(base, points, per_layout=True)
    for key, (scale, fixed) in constants.items():
        assert fitted.layout_fit[key][0] == pytest.approx(scale, rel=1e-4)
        assert fitted.layout_fit[key][1] == pytest.approx(fixed, rel=1e-3, abs=50)
    assert max(abs(e.relative) for e in errors(MemoryModel(TINY, fitted), points)) < 1e-5
    per_phase = MemoryModel(TINY, fit(base, points))
    assert max(abs(e.relative) for e in errors(per_phase, points)) > 0.02


def test_fit_cache_gives_the_same_settings():
    points = _points(MemoryModel(TINY, MemorySettings.cpu()), (DP2,))
    base = MemoryModel(TINY, MemorySettings.cpu())
    cache: dict = {}
    first = fit(base, points[:2], per_layout=True, cache=cache)
    assert len(cache) == 4
    assert fit(base, points, per_layout=True, cache=cache) == fit(base, points, per_layout=True)
    assert first != fit(base, points, per_layout=True)


def test_negative_fixed_bytes_never_go_below_the_static_state():
    settings = MemorySettings.cpu(fixed_bytes={"rollout": 0.0, "experience": -1e9, "train": -1e9})
    mem = MemoryModel(TINY, settings)
    for phase in ("experience", "train"):
        for layout in (DP2, TP2, PP2):
            work = PhaseWorkload.for_lengths(phase, [1] * 16, token_budget=512, dp=layout.dp)
            peak = mem.peak(phase, layout, work)
            assert peak.total == pytest.approx(peak.static + peak.overhead + peak.rotary_tables)


def test_loop_selectors_and_start_up_checks():
    from megatron_earl.config.loader import load_config
    from megatron_earl.orchestration.selection import build_selectors, selector_problems

    phases = "selector.phases=[rollout,experience,train]"
    config = load_config("configs/demo_cpu.yaml", ["selector.enabled=true", phases])
    selectors = build_selectors(config, 2, cuda=False)
    assert set(selectors) == {"rollout", "experience", "train"}
    # experience/train decide on the batch's exact lengths; rollout plans one step ahead
    assert selectors["experience"].config.lookahead_steps == 0
    assert selectors["train"].config.lookahead_steps == 0
    assert selectors["rollout"].config.lookahead_steps == 1
    assert all(c.cp == c.pp == 1 for c in selectors["rollout"].candidates)
    assert len(selectors["train"].candidates) == 4 and selector_problems(config, 2) == []
    bad = load_config(
        "configs/demo_cpu.yaml", ["selector.enabled=true", "train.use_distributed_optimizer=true"]
    )
    (message,) = selector_problems(bad, 2)
    assert "train.use_distributed_optimizer=true" in message and "drop train" in message


@pytest.mark.parametrize(
    "phase,predicted_mb,measure_above,measured",
    [
        ("train", 1.0, 0.0, True),  # 0: every run is measured
        ("experience", 0.0, 0.0, True),
        ("train", 511.0, 0.5, False),  # below half the 1024 MiB budget
        ("train", 512.0, 0.5, True),  # at the threshold
        ("experience", 900.0, 0.5, True),
        ("experience", 1023.0, 1.0, False),  # 1: only runs predicted at or past the budget
        ("train", 2048.0, 1.0, True),
        ("rollout", 900.0, 0.0, False),  # the engine's worker thread: never measured on CPU
    ],
)
def test_cpu_measured(phase, predicted_mb, measure_above, measured):
    from megatron_earl.orchestration.selection import cpu_measured

    mib = 1 << 20
    assert cpu_measured(phase, predicted_mb * mib, 1024 * mib, measure_above) is measured


def test_demo_selects_dp2_for_every_phase_without_measuring():
    """configs/demo_cpu.yaml: the selector (no profiling) chooses dp2 for rollout, experience and
    train at every context length the demo can produce (no reshard, no TP communication); the
    rollout candidates are the embedded engine's tp/dp layouts; the predicted peaks stay under
    ``measure_above`` x budget, so no run pays for the CPU memory accounting."""
    from megatron_earl.config.loader import load_config
    from megatron_earl.orchestration.selection import build_selectors, cpu_measured

    config = load_config("configs/demo_cpu.yaml")
    s = config.selector
    assert s.enabled and not s.profile
    selectors = build_selectors(config, 2, cuda=False)
    assert set(selectors) == {"rollout", "experience", "train"}
    assert [str(c) for c in selectors["rollout"].candidates] == ["tp1cp1pp1dp2", "tp2cp1pp1dp1"]
    n, longest = config.batch.samples_per_step, config.rollout.max_context
    rng = random.Random(0)
    batches = [[longest] * n, [1] * n] + [
        [rng.randint(20, hi) for _ in range(n)] for hi in (40, 120, longest) for _ in range(3)
    ]
    for phase, selector in selectors.items():
        for step, lengths in enumerate(batches):
            decision = selector.decide(phase, lengths, step=step)
            assert str(decision.layout) == "tp1cp1pp1dp2", (phase, lengths, decision.reason)
            assert not cpu_measured(
                phase, decision.peak_bytes, s.budget_mb * (1 << 20), s.measure_above
            ), (phase, decision.peak_bytes)


def test_preflight_refuses_a_max_context_whose_engine_kv_cache_exceeds_the_budget():
    """The hostile input: demo_cpu.yaml with rollout.max_context=100000 passed the start-up
    check, then each rank's embedded engine allocated its 64-row KV cache of 100000 tokens
    (12.2 GiB) before step 1, past the 8 GiB budget. The check now counts that cache and names
    the value, the estimate, the budget and the largest max_context that fits (which passes)."""
    import re

    from megatron_earl.cli.train import checked_config
    from megatron_earl.config.run import ConfigError

    demo = ["--config", "configs/demo_cpu.yaml"]
    with pytest.raises(ConfigError) as err:
        checked_config([*demo, "rollout.max_context=100000"], 2)
    message = str(err.value)
    assert "rollout.max_context (100000 tokens) does not fit selector.budget_mb" in message
    assert "(8192 MiB; 7.273 GiB per rank with the safety margin 10%)" in message
    assert "64 rows (rollout.max_concurrency, at most 64) x 100000 tokens = 12.207 GiB" in message
    assert "layouts.rollout=tp2cp1pp1dp1" in message
    largest = int(re.search(r"largest rollout.max_context tp1cp1pp1dp2 holds is (\d+)", message)[1])
    assert 50_000 < largest < 100_000
    checked_config([*demo, f"rollout.max_context={largest}"], 2)
    with pytest.raises(ConfigError, match=f"rollout.max_context \\({largest + 1} tokens\\)"):
        checked_config([*demo, f"rollout.max_context={largest + 1}"], 2)
    checked_config([*demo, "rollout.max_context=100000", "layouts.rollout=tp2cp1pp1dp1"], 2)
    checked_config(demo, 2)
