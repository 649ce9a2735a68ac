"""The trainer end to end, as users run it (``megatron-earl train`` -> torchrun, 2 processes):

- a run killed with SIGKILL during step 3 resumes from its step-2 checkpoint and the metrics of
  every step equal those of an uninterrupted run with the same seed (the demo config: the
  selector chooses every phase's layout, so its decisions resume too);
- the resumed run is started from the run's saved, fully resolved ``config.yaml`` (round trip:
  save, load, identical run);
- bad configuration fails at start-up with one clear error, before any process group.

Metrics compared: everything but wall-clock figures; floats within rel 1e-5 (generation batches
requests as they arrive, so engine log-probs may differ in the last bits between runs; sampled
tokens, rewards and losses do not).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.metrics_doc import check_documented

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "steps=4",
    "sft.steps=3",
    "eval.num_prompts=4",
    "eval.interval=2",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "checkpoint.interval=2",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "logging.tensorboard=false",
    "logging.progress=false",
]
WALL_CLOCK = (
    "time/",
    "time_busy/",
    "tokens_per_s",
    "train/tokens_per_s",
    "sync/reshard_s",
    "sync/weight_push_s",
    "sync/weight_transfer_s",
)


def _command(config: str | Path, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatron_earl.cli.main",
        "train",
        "--nproc",
        "2",
        "--config",
        str(config),
        *overrides,
    ]


def _run(config, overrides, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(config, overrides), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same(a: dict, b: dict) -> None:
    for key, value in a.items():
        if key.startswith(WALL_CLOCK) or key.endswith("/switch_s"):  # the selector's switch time
            continue
        other = b[key]
        if isinstance(value, float) and isinstance(other, float):
            assert math.isclose(value, other, rel_tol=1e-5, abs_tol=1e-7), (a["step"], key)
        else:
            assert value == other, (a["step"], key, value, other)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """An uninterrupted tiny run (4 steps, checkpoints at 2 and 4); its run directory."""
    out = tmp_path_factory.mktemp("runs")
    result = _run(ROOT / "configs" / "demo_cpu.yaml", [*TINY, f"output_dir={out}", "name=full"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "full"


def test_every_metric_is_documented_and_every_documented_metric_is_emitted(full_run):
    records = _metrics(full_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"eval/success_rate", "eval/reward"} <= set(records[1]) & set(records[3])
    check_documented(records, {"eval"})
    # the zero-advantage skip ran in RLLoop.run_step (train.skip_zero_advantage, on by default)
    skipped = [r["train/num_skipped_samples"] for r in records]
    assert any(skipped) and all(r["train/num_samples"] >= 2 for r in records), skipped


def test_dynamic_sampling_run_accounts_for_every_group(tmp_path):
    """The demo with ``rollout.dynamic_sampling`` on (2 steps, the selector choosing the rollout
    layout too): at every step drawn = kept + dropped and the dropped groups add up by verdict;
    every ``dynamic_sampling/*`` key is documented and emitted."""
    overrides = [
        *TINY,
        "steps=2",
        "eval.num_prompts=0",
        "checkpoint.interval=0",
        "rollout.dynamic_sampling.enabled=true",
        "rollout.dynamic_sampling.max_extra_prompts=4",
        f"output_dir={tmp_path}",
        "name=dynamic",
    ]
    result = _run(ROOT / "configs" / "demo_cpu.yaml", overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    records = _metrics(tmp_path / "dynamic")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        g = {k.split("/groups_")[1]: v for k, v in r.items() if "/groups_" in k}
        assert g["drawn"] == g["kept"] + g["dropped"], g
        by_verdict = g["dropped_all_correct"] + g["dropped_all_wrong"] + g["dropped_other"]
        assert g["dropped"] == by_verdict + g["surplus"], g
        assert g["missing"] == 4 - (g["kept"] - g["filler"]), g
        assert 4 <= g["drawn"] <= 4 + 4 and r["rollout/trajectories"] == 4 * g["drawn"]
    check_documented(records, {"dynamic_sampling"})


def test_sigkill_mid_step_resumes_to_identical_metrics(full_run, tmp_path):
    demo = ROOT / "configs" / "demo_cpu.yaml"
    reference = _metrics(full_run)
    assert [r["step"] for r in reference] == [1, 2, 3, 4]

    # Same run, killed (SIGKILL, whole process group) as soon as the step-2 checkpoint is out.
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(demo, [*TINY, f"output_dir={tmp_path}", "name=killed"]),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not (latest.exists() and "2" in latest.read_text()):
        assert proc.poll() is None, "the run ended before its step-2 checkpoint"
        assert time.monotonic() < deadline, "no step-2 checkpoint within 300 s"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    before = _metrics(run_dir)
    assert [r["step"] for r in before] == [1, 2], "the kill did not land during step 3"

    # Resume from the run's own resolved config (the round trip) and finish.
    resumed = _run(run_dir / "config.yaml", [])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _metrics(run_dir)
    assert [r["step"] for r in after] == [1, 2, 3, 4]
    for got, want in zip(after, reference, strict=True):
        _assert_same(want, got)
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4


def _engine_greedy(ckpt: str, model_fields: dict, prompt: list[int], n: int) -> list[int]:
    from megatron_earl.config.model import ModelConfig
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.convert.initial import load_initial_weights
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    use_layout(ParallelLayout())
    model = ModelConfig(**model_fields)
    chunks = build_model(model)
    load_initial_weights(chunks, ckpt)
    engine = EmbeddedEngine(chunks, model, EmbeddedEngineConfig(max_batch_size=1, max_seq_len=256))
    request = GenerateRequest(tuple(prompt), SamplingParams(max_new_tokens=n, temperature=0.0))
    result = run_engine(engine, lambda eng: eng.generate(request))
    return list(result.output_ids)


def test_trained_policy_exports_to_hf_with_identical_greedy_tokens(full_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from megatron_earl.config.loader import load_config
    from megatron_earl.envs.arithmetic import make_expression
    from megatron_earl.testing.distributed import run_distributed
    from megatron_earl.tokenizer.demo import DemoTokenizer

    hf_dir = tmp_path / "hf"
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_earl.cli.main",
            "convert",
            "mcore-to-hf",
            "--ckpt",
            str(full_run / "checkpoints"),
            "--out",
            str(hf_dir),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stderr[-3000:]
    config = load_config(full_run / "config.yaml")
    tokenizer = DemoTokenizer()
    prompt = tokenizer.render_messages(
        [{"role": "user", "content": make_expression(7, 2)}], add_generation_prompt=True
    )
    n = 24
    ours = run_distributed(
        _engine_greedy,
        1,
        args=(str(full_run / "checkpoints"), config.model.to_dict(), prompt, n),
        timeout_s=180,
    )[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert out[0, len(prompt) :].tolist() == ours


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["rollout.max_turn=3"], "rollout.max_turns"),
        (["train.lr=fast"], "train.lr"),
        (["layouts.train=tp4"], "layouts"),
        (["checkpoint.load=/nonexistent/ckpt"], "/nonexistent/ckpt"),
        # issue 22 item 9: env.kwargs were only used after the processes started
        (["env.kwargs.dificulty=3"], "unexpected keyword argument 'dificulty'"),
        (["env.kwargs.difficulty=hard"], "env.kwargs {'difficulty': 'hard'}: constructing"),
        (
            ["rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.metric=acc"],
            "rollout.dynamic_sampling.metric 'acc' is not a reward of this run",
        ),
    ],
)
def test_bad_config_fails_before_any_process_group(tmp_path, overrides, fragment):
    result = _run(
        ROOT / "configs" / "demo_cpu.yaml", [*overrides, f"output_dir={tmp_path}"], timeout=120
    )
    assert result.returncode != 0
    assert fragment in result.stderr
    assert "init_process_group" not in result.stderr
    assert not (tmp_path / "demo_cpu").exists()
