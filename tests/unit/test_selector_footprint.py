"""A run config's memory per GPU (``selector.footprint``): the embedded engine's KV cache sized
from the memory left after the weights and train state (``rollout.embedded.kv_memory_fraction``,
``kv_cache_mb``), ``megatron-earl plan CONFIG --gpu NAME`` on every shipped config, refusals
that name the term and the fix, and ``check`` running the same model. Pure: no processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_earl.config.embedded import (
    MAX_ENGINE_ROWS,
    EmbeddedRolloutConfig,
    EmbeddedRolloutConfigError,
    kv_cache_rows,
)
from megatron_earl.config.loader import load_config
from megatron_earl.config.run import ConfigError
from megatron_earl.config.vocab import Phase
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.footprint import (
    GPU_PRESETS,
    declared_gpu,
    footprint,
    gpu_preset,
    kv_sizing,
)
from megatron_earl.selector.memory import (
    GiB,
    MemoryModel,
    MemorySettings,
    MiB,
    PhaseWorkload,
    ReservedKV,
)
from megatron_earl.selector.plan_cli import main as plan_main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
QWEN = ROOT / "configs" / "qwen2.5-7b_grpo.yaml"
H100 = GPU_PRESETS["h100-80gb"].bytes
ROW_7B = 28 * 2 * 2 * 128 * 32768 * 2
"""One KV row of the 7B config at tp2: layers x K/V x 2 KV heads per rank x head dim x 32768
tokens x bf16 = 896 MiB."""


@pytest.mark.parametrize(
    "max_rows,row,budget,rows",
    [
        (64, 100, None, 64),  # no memory figure: the cap (today's CPU behaviour)
        (64, 100, 6400, 64),
        (64, 100, 6399, 63),
        (64, 100, 1e9, 64),  # a large budget: still the cap
        (8, 100, 250, 2),
        (8, 100, 99, 0),  # holds no row
        (8, 100, -5, 0),  # the weights and train state alone exceed the fraction
    ],
)
def test_kv_cache_rows(max_rows, row, budget, rows):
    assert kv_cache_rows(max_rows, row, budget) == rows


@pytest.mark.parametrize("fraction", [0, 0.0, -0.1, 1.01, 1.5, float("nan"), float("inf"), True])
def test_a_memory_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(
        EmbeddedRolloutConfigError, match=r"kv_memory_fraction .* must be a number in \(0, 1\]"
    ):
        EmbeddedRolloutConfig(kv_memory_fraction=fraction)


def test_memory_settings_are_validated_through_the_config():
    assert EmbeddedRolloutConfig(kv_memory_fraction=1).kv_memory_fraction == 1
    with pytest.raises(
        ConfigError, match=r"kv_memory_fraction \(1.2\) must be a number in \(0, 1\]"
    ):
        load_config(QWEN, ["rollout.embedded.kv_memory_fraction=1.2"])
    with pytest.raises(ConfigError, match=r"kv_cache_mb \(0.0\) must be a number of MiB > 0"):
        load_config(QWEN, ["rollout.embedded.kv_cache_mb=0"])


def test_an_unknown_gpu_names_the_valid_ones(capsys):
    with pytest.raises(
        ValueError, match="unknown GPU 'h100'; valid: a100-40gb, a100-80gb, h100-80gb"
    ):
        gpu_preset("h100")
    with pytest.raises(SystemExit) as exit_:
        plan_main([str(QWEN), "--gpu", "v100-16gb"])
    assert exit_.value.code == 2
    assert "unknown GPU 'v100-16gb'; valid: " + ", ".join(GPU_PRESETS) in capsys.readouterr().err
    assert gpu_preset("H100-80GB").memory_gib == 80


def test_7b_kv_cache_is_the_fraction_less_weights_and_train_state():
    """The arithmetic of docs/selector.md, "Memory on the GPU"."""
    config = load_config(QWEN)
    memory = MemoryModel(config.model, MemorySettings.gpu(train_state_resident=True))
    kv = kv_sizing(config, H100)
    assert kv.layout == ParallelLayout(tp=2, dp=4) and kv.row_bytes == ROW_7B
    weights, grads, optim = memory.train_state(ParallelLayout(tp=4, cp=2))
    rollout_copy = memory.stage_parameters(kv.layout) * 2  # bf16
    assert kv.resident_bytes == pytest.approx(weights + grads + optim + rollout_copy)
    assert kv.budget_bytes == pytest.approx(0.8 * H100 - kv.resident_bytes)
    assert kv.rows == math.floor(kv.budget_bytes / ROW_7B) == 40
    assert kv.max_rows == MAX_ENGINE_ROWS  # max_concurrency 128, capped
    # before: 64 rows whatever the GPU, 56 GiB
    assert 64 * ROW_7B == 56 * GiB


def test_without_a_memory_figure_the_rows_are_todays():
    config = load_config(ROOT / "configs" / "demo_cpu.yaml")
    kv = kv_sizing(config, None)
    assert (kv.rows, kv.budget_bytes) == (min(config.rollout.max_concurrency, 64), None)
    explicit = load_config(ROOT / "configs" / "demo_cpu.yaml", ["rollout.embedded.kv_cache_mb=1"])
    kv = kv_sizing(explicit, None)
    row = 4 * 2 * 2 * 32 * 256 * 4  # demo: 4 layers, 2 groups, head dim 32, 256 tokens, fp32
    assert (kv.row_bytes, kv.rows) == (row, MiB // row)


def test_engine_settings_carry_the_budget():
    from megatron_earl.orchestration.engines.embedded import engine_config

    config = load_config(QWEN)
    layout = ParallelLayout(tp=2, dp=4)
    assert engine_config(config, layout).kv_cache_bytes is None  # the CPU: no figure
    on_gpu = engine_config(config, layout, H100)
    assert on_gpu.kv_cache_bytes == pytest.approx(kv_sizing(config, H100).budget_bytes)
    assert on_gpu.max_batch_size == 64  # the cap; the engine allocates what the budget holds
    demo = load_config(ROOT / "configs" / "demo_cpu.yaml", ["rollout.embedded.kv_cache_mb=3"])
    assert engine_config(demo, ParallelLayout(dp=2)).kv_cache_bytes == 3 * MiB


def test_selector_memory_model_sizes_reserved_rows_like_the_engine():
    config = load_config(QWEN)
    memory = MemoryModel(config.model, MemorySettings.gpu())
    layout = ParallelLayout(tp=2, dp=4)
    row = memory.kv_row_bytes(layout, 32768)
    assert row == ROW_7B
    share = ReservedKV(64, 32768, static_share_bytes=0.8 * H100)
    work = PhaseWorkload(Phase.ROLLOUT, 32768, 32768, reserved_kv=share)
    assert memory.kv_cache(layout, work, static_bytes=30 * GiB) == 38 * ROW_7B  # 34 GiB / 0.875
    assert memory.kv_cache(layout, work, static_bytes=70 * GiB) == ROW_7B  # one row at least
    explicit = ReservedKV(64, 32768, budget_bytes=10 * GiB)
    work = PhaseWorkload(Phase.ROLLOUT, 32768, 32768, reserved_kv=explicit)
    assert memory.kv_cache(layout, work, static_bytes=70 * GiB) == 11 * ROW_7B


def test_every_phase_peak_is_the_fraction_plus_its_own_transient():
    """By construction: resident state + cache <= fraction x memory, so a phase's peak is at most
    that plus its activations, buffers, RoPE tables and overhead."""
    for fraction in (0.5, 0.7, 0.8):
        config = load_config(QWEN, [f"rollout.embedded.kv_memory_fraction={fraction}"])
        fp = footprint(config, H100)
        for p in fp.phases:
            resident = p.terms["weights"] + p.terms["train_state"] + p.terms["kv_cache"]
            assert resident <= fraction * H100
            assert p.total == pytest.approx(resident + p.terms["rotary_tables"] + p.transient)
        assert [p.phase for p in fp.phases] == [Phase.ROLLOUT, Phase.EXPERIENCE, Phase.TRAIN]


def test_every_shipped_config_names_its_gpu():
    assert CONFIGS
    for path in CONFIGS:
        assert declared_gpu(path) in GPU_PRESETS, f"{path.name}: no '# gpu: NAME' line"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_passes_plan_on_its_gpu(path, capsys):
    assert plan_main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f" x {declared_gpu(path)} (" in lines[0]
    assert (
        lines[-1].startswith("fits: headroom ") and "GiB per GPU on the tightest phase" in lines[-1]
    )
    rows = [line.split() for line in lines if line.split()[0] in (Phase.EXPERIENCE, Phase.TRAIN)]
    assert rows and all(float(r[-1]) > 0 for r in rows)  # headroom per phase


def test_the_7b_colocated_config_fits_an_h100_with_headroom():
    fp = footprint(load_config(QWEN), H100)
    assert fp.problems == [] and fp.headroom > 2 * GiB
    assert fp.kv.rows == 40


def test_todays_64_rows_do_not_fit_and_are_refused_naming_the_cache(capsys):
    """The allocation before this change (64 rows x 32768, 56 GiB) on an 80 GB GPU."""
    assert plan_main([str(QWEN), "--gpu", "h100-80gb", "rollout.embedded.kv_cache_mb=57344"]) == 1
    out = capsys.readouterr().out
    assert "does not fit:" in out
    assert "train in tp4cp2pp1dp1 needs 97.79 GiB per GPU, over the GPU's 80.00 GiB" in out
    assert "the largest term is kv_cache" in out
    assert "rollout.embedded.kv_cache_mb <= 38528" in out  # 43 rows fit beside the train phase


def test_a_fraction_too_large_names_the_fraction_that_fits():
    fp = footprint(load_config(QWEN, ["rollout.embedded.kv_memory_fraction=0.95"]), H100)
    train = [p for p in fp.problems if p.startswith("train in")]
    assert train and "rollout.embedded.kv_memory_fraction <= 0.83" in train[0]


def test_a_cache_that_holds_no_row_is_refused_naming_the_cache():
    fp = footprint(load_config(QWEN, ["rollout.embedded.kv_memory_fraction=0.3"]), H100)
    (problem,) = fp.problems
    assert problem.startswith("KV cache: rollout.embedded.kv_memory_fraction 0.3 x 80.00 GiB")
    assert "holds no row (one row of rollout.max_context (32768 tokens) at tp2cp1pp1dp4" in problem
    assert "rollout.embedded.kv_memory_fraction >= 0.37" in problem
    fp = footprint(load_config(QWEN, ["rollout.embedded.kv_cache_mb=500"]), H100)
    (problem,) = fp.problems
    assert "rollout.embedded.kv_cache_mb (500 MiB)" in problem and "kv_cache_mb >= 896" in problem
    assert "rollout.max_context <= 18285" in problem


def test_a_train_state_that_does_not_fit_names_the_layout(capsys):
    assert plan_main([str(QWEN), "--gpu", "a100-40gb"]) == 1
    out = capsys.readouterr().out
    assert "train in tp4cp2pp1dp1 needs" in out and "the largest term is train_state" in out
    assert "a layouts.train that holds less per GPU" in out


def test_plan_json_and_the_model_form_still_work(capsys):
    import json

    assert plan_main([str(QWEN), "--gpu-memory", "80", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_cache"]["rows"] == 40 and data["problems"] == []
    assert [p["phase"] for p in data["phases"]] == ["rollout", "experience", "train"]
    assert plan_main(["--model", "qwen2.5-7b", "--gpus", "32", "--gpu", "h100-80gb",
                      "--context", "4k", "--phase", "train"]) == 0  # fmt: skip
    assert "plan: qwen2.5-7b on 32 GPUs x 80 GB" in capsys.readouterr().out


def test_check_runs_the_same_model(capsys):
    from megatron_earl.cli.check import main as check

    args = ["--world-size", "8", "--config", str(QWEN), "tokenizer=demo"]
    assert check(args) == 0  # the config's own GPU (h100-80gb)
    out = capsys.readouterr().out
    assert "memory on h100-80gb: peak 76.8 GiB (train), headroom 3.2 GiB per GPU" in out
    assert check([*args, "--gpu", "a100-40gb"]) == 2
    err = capsys.readouterr().err
    assert "does not fit a100-40gb" in err and "the largest term is train_state" in err
    assert check([*args, "rollout.embedded.kv_cache_mb=57344"]) == 2
    assert "the largest term is kv_cache" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check([*args, "--gpu", "tpu-v5"])
    assert "valid: a100-40gb" in capsys.readouterr().err


def test_train_refuses_a_config_that_does_not_fit_the_nodes_gpu(monkeypatch, capsys):
    """``megatron-earl train``'s pre-flight (``cli.checked_torchrun``, in torchrun's process)
    models the memory on the node's GPU (``nvidia-smi``; faked here with an 80 GiB one) and
    refuses before any worker starts; without a GPU it does not model it."""
    from megatron_earl.cli import checked_torchrun

    started = []
    monkeypatch.setattr("torch.distributed.run.main", lambda argv: started.append(argv))
    argv = ["--standalone", "--nproc_per_node=8", "-m", "megatron_earl.cli.train", "--config",
            str(QWEN), "tokenizer=demo", "rollout.embedded.kv_cache_mb=57344"]  # fmt: skip
    monkeypatch.setattr(checked_torchrun, "local_gpu", lambda: ("NVIDIA H100 80GB HBM3", H100))
    assert checked_torchrun.main(argv) == 2
    err = capsys.readouterr().err
    assert "config error: does not fit NVIDIA H100 80GB HBM3 (80.0 GiB)" in err
    assert "the largest term is kv_cache" in err and not started
    monkeypatch.setattr(checked_torchrun, "local_gpu", lambda: None)
    assert checked_torchrun.main(argv) == 0 and len(started) == 1
