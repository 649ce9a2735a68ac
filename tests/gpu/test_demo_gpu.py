"""The demo's RL step on CUDA, through the trainer's own entry point (``cli.train.main``: the
start-up checks, the device policy, NCCL device groups beside gloo host groups): rollout on the
embedded engine, dispatch, experience, train, reshard and the weight push, on 1 GPU (every phase
tp1dp1) and on 2 GPUs (the switching demo config's pinned layouts: rollout dp2, experience and
train tp2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_earl.testing.distributed import run_distributed
from tests.gpu import requires_gpus

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "steps=2",
    "sft.steps=3",
    "eval.num_prompts=4",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "logging.tensorboard=false",
    "logging.progress=false",
]
ONE_RANK = [f"layouts.{phase}=tp1cp1pp1dp1" for phase in ("rollout", "experience", "train")]


def _main(argv: list[str]) -> int:
    from megatron_earl.cli.train import main

    return main(argv)


@requires_gpus(1)
@pytest.mark.parametrize("world", [pytest.param(1), pytest.param(2, marks=requires_gpus(2))])
def test_demo_steps_on_gpus(tmp_path, world):
    overrides = [*TINY, *(ONE_RANK if world == 1 else []), f"output_dir={tmp_path}", "name=demo"]
    argv = ["--config", str(ROOT / "configs/demo_cpu_switching.yaml"), *overrides]
    assert run_distributed(_main, world, args=(argv,), timeout_s=600) == [0] * world
    lines = (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert all(math.isfinite(v) for v in s.values() if isinstance(v, float)), s
