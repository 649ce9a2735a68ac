"""A mixture-of-experts model through the RL loop, as users run it (``megatron-earl train`` on 2
processes, ``configs/demo_moe_cpu.yaml`` made tiny): the embedded engine rolls out with
megatron-core's MoE layers at dp2, the experience pass runs at tp2 (experts split over TP) and
the train step at tp2 ep2 etp1 (two experts per rank), so the dense and the expert weights are
resharded between three layouts every step. Two steps complete, both phases' weights move, and
the engine's log-probs equal the trainer's recomputation of the same policy within the fp32
bound of a forward's sums in another order (the router sees the same hidden states up to that
bound, so both sides route alike), with routing replay and without it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_earl.config import load_config
from tests.integration.metrics_doc import check_documented
from tests.tolerances import fp32_tol, gpt_terms

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_moe_cpu.yaml"
TINY = [
    "steps=2",
    "sft.steps=3",
    "eval.num_prompts=0",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "checkpoint.interval=0",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_experts=4",
    "model.moe_ffn_hidden_size=32",
    "logging.tensorboard=false",
    "logging.progress=false",
    "train.skip_zero_advantage=false",  # every sample's tokens in the mismatch, not the few
]


def _run(tmp_path, *overrides: str) -> list[dict]:
    command = [sys.executable, "-m", "megatron_earl.cli.main", "train", "--nproc", "2"]
    result = subprocess.run(
        [*command, "--config", str(CONFIG), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    return records


@pytest.mark.parametrize(
    "routing,measured",
    [(["routing.replay=rollout"], False), (["routing.replay=none", "routing.measure=true"], True)],
    ids=["replay", "measure"],
)
def test_moe_run_rolls_out_and_trains_across_expert_parallel_layouts(tmp_path, routing, measured):
    """Replay (``routing.replay: rollout``) routes the trainer's forwards as the engine did
    (its routes travel with the samples from the dp2 rollout to the tp2 and tp2 ep2 forwards,
    split over sequence parallelism there); measuring reports how often the trainer's own
    routing differs from the engine's. Either way the log-probs agree within the bound."""
    overrides = [*TINY, f"output_dir={tmp_path}", "name=moe", *routing]
    records = _run(tmp_path, *overrides)
    check_documented(records, {"routing_measure"} if measured else set())
    config = load_config(CONFIG, overrides)
    # a mean |difference| of log-probs: the bound of one log-prob's chain of fp32 sums over the
    # longest context, terms of magnitude <= 1 (this initialisation's activations and logits)
    bound = fp32_tol(gpt_terms(config.model, config.rollout.max_context), 1.0)
    for r in records:
        assert r["sync/reshard_bytes_sent"] > 0  # rollout <-> experience <-> train layouts
        assert r["train/num_tokens"] > 500  # 16 samples' response tokens
        assert 0 <= r["rollout/logprob_mismatch"] <= bound, (r["rollout/logprob_mismatch"], bound)
        if measured:  # same policy, same hidden states up to fp32 sums: near-ties only
            assert r["routing/compared"] > 0
            assert 0 <= r["routing/disagreement"] < 0.05, r["routing/disagreement"]
