"""``bench peer`` end to end on a tiny setting (needs trl: the ``[bench]`` extra; skipped without):

- the TRL side's multi-turn workload on real ``GRPOTrainer`` (its ``rollout_func`` path) trains
  and reports per-step times and completion tokens within the workload's bounds, and the
  positions its update's forward computes (its padded batch: at least the real tokens);
- the whole command (start weights, our run under torchrun, the TRL run, the report) for one
  pair of the single-turn workload, two steps per run, ours on one process, TRL on two (torchrun,
  gloo: the multi-process path; the one-process path is the test above).

Run: python -m pytest -q -p no:warnings tests/integration/test_bench_peer.py
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl", reason="bench peer needs TRL: pip install -e '.[bench]'")

from megatron_earl.bench.peer_workload import WORKLOADS, PeerSettings, workload_config

TINY = [
    "batch.prompts_per_step=2",
    "batch.samples_per_prompt=2",
    "rollout.sampling.max_new_tokens=8",
    "model.num_layers=2",
    "sft.steps=2",
    "sft.examples_per_step=4",
    *(f"layouts.{phase}=tp1cp1pp1dp1" for phase in ("rollout", "experience", "train")),
]


def test_trl_side_runs_the_multi_turn_workload(tmp_path):
    from megatron_earl.bench.peer_trl import run
    from megatron_earl.convert.tiny import save_tiny_hf

    workload = WORKLOADS["multi-turn-tool"]
    settings = PeerSettings.from_run(
        workload_config("configs/demo_cpu.yaml", workload, TINY), workload
    )
    hf_dir = save_tiny_hf("llama", tmp_path / "hf", vocab_size=320, std=0.02)
    result = run(settings, str(hf_dir), steps=2, work_dir=str(tmp_path / "trl"))
    assert result["generation"] == "rollout_func on _generate_single_turn"
    assert len(result["steps"]) == 2
    for step in result["steps"]:
        assert step["samples"] == 4
        assert 4 <= step["completion_tokens"] <= 4 * settings.max_turns * 8
        assert 0 < step["time/generate"] < step["time/step"]
        # the padded batch: at least the real tokens, and a multiple of the 4 rows
        assert step["forward_positions"] >= step["real_tokens"] > step["completion_tokens"]
        assert step["forward_positions"] % 4 == 0


@pytest.mark.slow
def test_bench_peer_end_to_end(tmp_path):
    from megatron_earl.bench.peer import main

    out = tmp_path / "peer.json"
    argv = ["--workloads", "single-turn", "--pairs", "1", "--steps", "2", "--nproc", "1"]
    argv += ["--trl-nproc", "2", "--decode", "eager"]  # the compiled step: test_engine_compile
    argv += ["--work-dir", str(tmp_path / "work"), "--json", str(out), *TINY]
    assert main(argv) == 0
    doc = json.loads(out.read_text())["single-turn"]
    assert doc["settings"]["samples_per_prompt"] == 2 and doc["settings"]["max_turns"] == 1
    assert list(doc["info"]["trl_threads"]) == ["2"] and doc["info"]["nproc"] == 1
    assert doc["info"]["ours_decode"] == "eager"
    ours_config = (tmp_path / "work" / "ours-single-turn-0" / "config.yaml").read_text()
    assert "compile_decode: false" in ours_config
    (pair,) = doc["pairs"]
    for summary in (pair["ours"], pair["trl"]["2"]):
        assert summary["s_per_step"] > 0 and summary["tokens_per_s"] > 0
        assert 4 <= summary["tokens_per_step"] <= 4 * 8  # 4 samples, one turn of <= 8 tokens
        assert summary["forward_per_step"] > 0 and summary["real_per_step"] > 0
