"""``megatron-earl bench async-sim``: the projection's placements (GPUs -> engines and trainer),
its JSON (labelled simulated, the published figures with their settings) and its errors."""

from __future__ import annotations

import json

import pytest

from megatron_earl.bench.async_sim import PUBLISHED, Assumptions
from megatron_earl.cli.main import main as cli_main


def test_placements_map_gpus_to_engines_and_trainer():
    a = Assumptions()
    sync = a.sync_config(64, steps=3, seed=0)
    assert sync.num_engines == 16 and sync.mode == "sync"  # every GPU rolls out, TP4 engines
    assert sync.train_s_per_token == pytest.approx(a.train_gpu_s_per_token / 64)  # all train
    assert sync.prompts_per_step * sync.group_size == 8 * 64
    asy = a.async_config(64, steps=3, seed=0, k=2)
    assert asy.num_engines == 12 and asy.max_staleness == 2  # 48 rollout GPUs
    assert asy.train_s_per_token == pytest.approx(a.train_gpu_s_per_token / 16)  # 16 train
    assert asy.push_s == a.push_s_disaggregated and sync.push_s == a.push_s_colocated


def test_cli_prints_a_labelled_projection(capsys):
    argv = ["bench", "async-sim", "--gpus", "64", "--steps", "3", "--staleness", "1", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert "SIMULATED" in out["label"]
    schedules = [r["schedule"] for r in out["rows"]]
    assert schedules == ["sync colocated", "async k=1 continue", "async k=1 restart"]
    sync, cont, restart = out["rows"]
    assert sync["speedup"] == 1.0 and cont["speedup"] > 1.0
    assert restart["wasted_tokens"] > 0 and cont["wasted_tokens"] == 0
    assert out["assumptions"]["lengths"]["p99_over_p50"] > 5
    assert [p["system"] for p in out["published"]] == [p["system"] for p in PUBLISHED]
    assert {"RollArt", "AReaL", "Laminar"} == {p["system"] for p in out["published"]}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "64,x"], "comma-separated integers, got '64,x'"),
        (["--steps", "1"], "--steps must be > 1"),
        (["--gpus", "2"], "2 GPUs: 2 rollout GPUs (engines of 4)"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "async-sim", *argv])
    assert message in capsys.readouterr().err


def test_measured_inputs_run_sync_and_async(tmp_path, capsys):
    path = tmp_path / "measured.json"
    fields = {
        "num_engines": 2,
        "slots_per_engine": 8,
        "decode_s_per_token": 0.05,
        "lengths": [20, 25, 30, 40, 60, 200, 35, 22],
        "tokens_per_turn": 16,
        "env_step_s": 0.1,
        "group_size": 4,
        "prompts_per_step": 2,
        "train_s_per_token": 0.002,
        "train_s_fixed": 1.0,
        "push_s": 0.5,
        "num_steps": 6,
    }
    path.write_text(json.dumps(fields))
    assert cli_main(["bench", "async-sim", "--config", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in out["rows"]][:2] == ["sync", "async k=1 continue"]
    assert out["rows"][0]["speedup"] == 1.0 and out["rows"][1]["speedup"] > 1.0
    assert out["lengths"]["kind"] == "empirical" and out["lengths"]["max"] == 200
    path.write_text(json.dumps(fields | {"decode_ms": 3}))
    with pytest.raises(SystemExit):
        cli_main(["bench", "async-sim", "--config", str(path)])
    assert "unknown simulator fields ['decode_ms']" in capsys.readouterr().err


def test_assumptions_can_be_changed_and_bad_changes_are_named():
    from megatron_earl.bench.async_sim import with_changes

    a = with_changes(Assumptions(), ["rollout_fraction=0.5", "lengths.shape=0.5", "group_size=8"])
    assert (a.rollout_fraction, a.lengths.shape, a.group_size) == (0.5, 0.5, 8)
    assert a.async_config(64, steps=3, seed=0, k=1).num_engines == 8
    with pytest.raises(ValueError, match="unknown field 'foo'"):
        with_changes(Assumptions(), ["foo=1"])
    with pytest.raises(ValueError, match=r"--set 'lengths.shape=-1': .*shape > 0"):
        with_changes(Assumptions(), ["lengths.shape=-1"])
