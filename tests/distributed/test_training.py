"""Megatron DDP + ``get_megatron_optimizer`` on CPU: a tiny model learns a fixed synthetic batch at
TP1, TP2, PP2 and DP2 with the plain and the distributed optimizer, and after 3 steps the parameters
of every layout equal the single-process run from the same weights and data (within the fp32
bounds of ``tests/tolerances.py``: Adam with ``ADAM_EPS``)."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import ADAM_EPS, adam_loss_tol, gpt_terms, grad_maxima, weight_tol

LR = 3e-3
MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=96,
    make_vocab_size_divisible_by=32,
)
SEQ, NUM_TOKENS = 16, 4 * 2 * 16  # synthetic_lm_batches below: 4 micro-batches of 2 x 16
NUM_TERMS = gpt_terms(MODEL, SEQ, grad_tokens=NUM_TOKENS)
"""A gradient's chain of fp32 sums (forward, backward, the step's tokens): ~2.8e3 terms."""
FORWARD_TERMS = gpt_terms(MODEL, SEQ)
"""A loss's (~1.3e3)."""


def _train(
    layout: ParallelLayout,
    distributed_optimizer: bool,
    weights,
    steps: int,
    fused: bool = True,
    adam_eps: float = ADAM_EPS,
):
    from megatron.core import parallel_state

    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import (
        full_state_dict,
        load_full_state_dict,
        shard_pieces,
    )
    from megatron_earl.training.setup import (
        OptimConfig,
        build_optimizer,
        wire_schedule_hooks,
        wrap_ddp,
    )
    from megatron_earl.training.step import synthetic_lm_batches, train_step

    use_layout(layout)
    runtime.seed(11)
    chunks = build_model(MODEL, vpp=layout.vpp)
    if weights is None and layout.world_size == 1:
        weights = full_state_dict(chunks)
    if weights is not None:
        load_full_state_dict(chunks, weights)
    optim = OptimConfig(
        lr=LR, clip_grad=1.0, adam_eps=adam_eps, use_distributed_optimizer=distributed_optimizer
    )
    ddp = wrap_ddp(chunks, optim)
    optimizer = build_optimizer(ddp, optim)
    groups = [g for o in optimizer.chained_optimizers for g in o.optimizer.param_groups]
    if not fused:  # torch's per-tensor loop, as Megatron builds it
        for group in groups:
            group["fused"] = False
    wire_schedule_hooks(ddp, optimizer)
    batches = synthetic_lm_batches(
        MODEL.vocab_size, num_micro_batches=4, micro_batch_size=2, seq_length=SEQ, seed=5
    )
    dp_rank, dp = (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )
    losses, norms, grads = [], [], []
    for _ in range(steps):
        metrics = train_step(ddp, optimizer, batches[dp_rank::dp])
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
        grads.append(grad_maxima(shard_pieces(chunks)))  # reduced for this rank's shard only
    params = [(p.key, p.region, p.local.detach().clone()) for p in shard_pieces(chunks)]
    fused_groups = sum(bool(g["fused"]) for g in groups)
    return {
        "weights": weights,
        "losses": losses,
        "grad_norms": norms,
        "grad_max": grads,
        "params": params,
        "fused_groups": (fused_groups, len(groups)),
    }


def _fused_and_loop():
    fused = _train(ParallelLayout(), False, None, 3)
    return fused, _train(ParallelLayout(), False, fused["weights"], 3, fused=False)


def test_torch_adam_runs_its_fused_kernel_with_the_loops_updates():
    """Without TE/Apex Megatron builds torch's AdamW; ``build_optimizer`` switches it to torch's
    fused kernel (every group), and 3 steps give the per-tensor loop's parameters (the kernels
    order Adam's element-wise operations differently: rounding of the weights, then gradients
    that one rounding apart weights give)."""
    fused, loop = run_distributed(_fused_and_loop, 1, timeout_s=120)[0]
    groups = fused["fused_groups"][1]
    assert groups >= 1 and fused["fused_groups"] == (groups, groups)
    assert loop["fused_groups"] == (0, groups)
    for (key, region, a), (_, _, b) in zip(fused["params"], loop["params"], strict=True):
        # step 1's gradients are the same bits; steps 2 and 3 see weights a rounding apart,
        # which moves a gradient by at most about its own rounding bound
        grad_max = [0.0, *(step[key] for step in fused["grad_max"][1:])]
        tol = weight_tol(LR, NUM_TERMS, grad_max, b)
        torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=f"{key} {region}")
    # the third loss comes 2 steps after the last common weights (~1.1e-3 here)
    loss_tol = adam_loss_tol(max(loop["losses"]), FORWARD_TERMS, NUM_TERMS, LR, steps=2)
    assert fused["losses"] == pytest.approx(loop["losses"], abs=loss_tol)


def _losses_of(results):
    """Loss curve averaged over the ranks that computed it (the last pipeline stage's DP ranks)."""
    curves = [r["losses"] for r in results if r["losses"] and r["losses"][0] == r["losses"][0]]
    return [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_train, 1, args=(ParallelLayout(), False, None, 3), timeout_s=120)[0]


CASES = [
    (ParallelLayout(), False),
    (ParallelLayout(tp=2), False),
    (ParallelLayout(pp=2), False),
    (ParallelLayout(dp=2), False),
    (ParallelLayout(dp=2), True),
    (ParallelLayout(tp=2), True),
]


@pytest.mark.parametrize("layout,dist_opt", CASES, ids=lambda c: str(c))
def test_parameters_after_steps_equal_single_process(reference, layout, dist_opt):
    results = run_distributed(
        _train, layout.world_size, args=(layout, dist_opt, reference["weights"], 3), timeout_s=240
    )
    ref = {(k, r): t for k, r, t in reference["params"]}
    for res in results:
        for key, region, tensor in res["params"]:
            # Megatron regions are per layer; the reference holds the same regions (TP/PP merged).
            matches = [t for (k, r), t in ref.items() if k == key and _contains(r, region)]
            assert matches, (key, region)
            expected = _crop(matches[0], ref_region(ref, key, region), region)
            # Adam's 3 steps on gradients within their fp32 bound: ~6e-7 (norms) to ~4e-5
            # (output layer), >1e2 below what each parameter's 3 steps move it by
            grad_max = [step[key] for step in reference["grad_max"]]
            tol = weight_tol(LR, NUM_TERMS, grad_max, expected)
            torch.testing.assert_close(tensor, expected, rtol=0, atol=tol)
    losses = _losses_of(results)
    # the third loss comes 2 steps after the common initial weights (~1.1e-3 here)
    loss_tol = adam_loss_tol(max(reference["losses"]), FORWARD_TERMS, NUM_TERMS, LR, steps=2)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference["losses"]), rtol=0, atol=loss_tol
    )


def ref_region(ref, key, region):
    return next(r for (k, r) in ref if k == key and _contains(r, region))


def _contains(outer, inner) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner, strict=True))


def _crop(tensor, outer, inner):
    """The part of ``tensor`` (holding region ``outer``) that covers region ``inner``."""
    shape = [b - a for a, b in outer]
    t = tensor.reshape(shape)
    sl = tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, inner, strict=True))
    return t[sl].reshape([d - c for c, d in inner]).squeeze()


@pytest.mark.parametrize(
    "layout", [ParallelLayout(tp=2), ParallelLayout(pp=2), ParallelLayout(dp=2)], ids=str
)
def test_tiny_model_learns_fixed_batch(layout):
    results = run_distributed(
        _train,
        2,
        args=(layout, layout.dp > 1, None, 12),
        kwargs={"adam_eps": 1e-8},  # Adam's default: the equivalence tests' ADAM_EPS learns slower
        timeout_s=240,
    )
    losses = _losses_of(results)
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(n == n for r in results for n in r["grad_norms"])
