"""Megatron's distributed optimizer on NCCL (``train.use_distributed_optimizer=true``): three train
steps in DP2 and TP2 on 2 GPUs, with the optimizer state sharded over DP (the gradients
reduce-scattered and the updated weights all-gathered by NCCL), give the parameters and losses of
the plain optimizer on 1 GPU from the same weights and data, with the body of
tests/distributed/test_training.py.

Tolerance: test_training's, derived from fp32 arithmetic (``tests/tolerances.py``: Adam with
``ADAM_EPS``, ``weight_tol`` per parameter, ``adam_loss_tol`` for the losses). The bounds hold
for any summation order, so for CUDA's kernels as for the CPU's, as long as fp32 matmuls run in
fp32: every rank reports torch's float32 matmul precision and the test requires "highest" (TF32,
"high", has a unit roundoff of 2^-11 instead of 2^-24 and would void the bounds)."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed import test_training as cpu
from tests.gpu import requires_gpus, to_host
from tests.tolerances import adam_loss_tol, weight_tol

pytestmark = pytest.mark.gpu
STEPS = 3


def _train_on_host(layout: ParallelLayout, distributed_optimizer: bool, weights):
    """``test_training._train`` on this rank's GPU; the result on the host, with the optimizer
    classes Megatron built and the fp32 matmul precision."""
    from megatron_earl.training import setup

    built: list[str] = []
    build_optimizer = setup.build_optimizer

    def recording(ddp, optim):
        optimizer = build_optimizer(ddp, optim)
        built.extend(type(o).__name__ for o in optimizer.chained_optimizers)
        return optimizer

    setup.build_optimizer = recording  # test_training._train imports it at call time
    try:
        res = cpu._train(layout, distributed_optimizer, weights, STEPS)
    finally:
        setup.build_optimizer = build_optimizer
    res["optimizers"] = built
    res["matmul_precision"] = torch.get_float32_matmul_precision()
    return to_host(res)


@pytest.fixture(scope="module")
def reference():
    (res,) = run_distributed(_train_on_host, 1, args=(ParallelLayout(), False, None), timeout_s=300)
    return res


@requires_gpus(2)
@pytest.mark.parametrize("layout", [ParallelLayout(dp=2), ParallelLayout(tp=2)], ids=str)
def test_distributed_optimizer_on_two_gpus_equals_one(reference, layout):
    assert reference["matmul_precision"] == "highest", reference["matmul_precision"]
    results = run_distributed(
        _train_on_host, 2, args=(layout, True, reference["weights"]), timeout_s=300
    )
    ref = {(k, r): t for k, r, t in reference["params"]}
    for rank, res in enumerate(results):
        assert res["matmul_precision"] == "highest", (rank, res["matmul_precision"])
        assert res["optimizers"] and all(
            name == "DistributedOptimizer" for name in res["optimizers"]
        ), (rank, res["optimizers"])
        for key, region, tensor in res["params"]:
            matches = [t for (k, r), t in ref.items() if k == key and cpu._contains(r, region)]
            assert matches, (key, region)
            expected = cpu._crop(matches[0], cpu.ref_region(ref, key, region), region)
            grad_max = [step[key] for step in reference["grad_max"]]
            tol = weight_tol(cpu.LR, cpu.NUM_TERMS, grad_max, expected)
            torch.testing.assert_close(tensor, expected, rtol=0, atol=tol, msg=f"rank {rank} {key}")
    losses = cpu._losses_of(results)
    loss_tol = adam_loss_tol(
        max(reference["losses"]), cpu.FORWARD_TERMS, cpu.NUM_TERMS, cpu.LR, steps=STEPS - 1
    )
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference["losses"]), rtol=0, atol=loss_tol
    )
