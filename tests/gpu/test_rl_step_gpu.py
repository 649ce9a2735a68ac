"""The RL train step on CUDA (NCCL), with the bodies of tests/distributed/test_rl_step.py: two
steps in TP2, DP2, PP2 and CP2 on 2 GPUs equal one GPU on the same data; GRPO on the toy bandit
raises the rewarded token's probability on 1 GPU; bad input is handled the documented way on
every rank of 2 GPUs.

The model is built with the local implementation (SDPA attention), so these isolate the device
path (placement, NCCL device groups, gloo host groups); Transformer Engine: test_te_gpu.py.

Tolerance 1e-4 (the CPU tier's is 1e-5): CUDA kernels reduce in other orders than the CPU ones,
and cuBLAS picks algorithms per shape, so TP/CP shards are not bitwise a single GPU's sum."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed import test_rl_step as cpu
from tests.gpu import requires_gpus, to_host

pytestmark = pytest.mark.gpu
GPU_TOL = 1e-4
LOCAL = dataclasses.replace(cpu.MODEL, transformer_impl="local")


def _train_on_host(layout: ParallelLayout, weights, steps: int):
    return to_host(cpu._train(layout, weights, steps, LOCAL))


@pytest.fixture(scope="module")
def reference():
    (res,) = run_distributed(_train_on_host, 1, args=(ParallelLayout(), None, 2), timeout_s=300)
    return res


@requires_gpus(1)
def test_train_step_runs_on_one_gpu(reference):
    m = reference["metrics"][0]
    assert m["num_samples"] == len(cpu.LENGTHS) and m["update_ok"] == 1
    assert torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all()


@requires_gpus(2)
@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(tp=2), ParallelLayout(dp=2), ParallelLayout(pp=2), ParallelLayout(cp=2)],
    ids=str,
)
def test_train_step_on_two_gpus_equals_one(reference, layout):
    from megatron_earl.redistribute.geometry import region_slices

    results = run_distributed(
        _train_on_host, 2, args=(layout, reference["weights"], 2), timeout_s=300
    )
    final = reference["final"]
    for res in results:
        for key, region, local in res["params"]:
            expected = final[key][region_slices(region)].reshape(local.shape)
            torch.testing.assert_close(local, expected, rtol=0, atol=GPU_TOL, msg=key)
        for got, want in zip(res["metrics"], reference["metrics"], strict=True):
            for k in cpu.COMPARED:
                assert abs(got[k] - want[k]) <= GPU_TOL * max(1.0, abs(want[k])), (k, got, want)
            assert got["skipped_step"] == 0 and got["update_ok"] == 1


@requires_gpus(1)
def test_grpo_bandit_raises_target_probability_on_gpu():
    (probs,) = run_distributed(cpu._bandit, 1, timeout_s=300)
    assert probs[-1] > probs[0] + 0.3, probs
    assert probs[-1] > 3 * probs[0], probs


@requires_gpus(2)
def test_bad_input_is_reported_or_rejected_on_every_gpu_rank():
    results = run_distributed(cpu._bad_inputs, 2, timeout_s=300)
    for out in results:
        assert out["drop"]["num_nonfinite_samples"] == 1 and out["drop"]["skipped_step"] == 0
        assert "rank 1: ValueError: samples [0]" in out["raise"]
        assert out["empty"]["num_empty_samples"] == 1
        assert "rank 0: " in out["budget"] and "above the micro-batch budget" in out["budget"]
        assert "rank 1: ValueError: this rank has 0 samples" in out["no_samples"]
        assert out["nan_weight"]["skipped_step"] == 1 and out["unchanged"]
