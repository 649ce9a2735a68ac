"""Tolerances of the numerical equivalence tests, derived from fp32 arithmetic, not from a machine.

    assert_fp32_close(got, want, gpt_terms(MODEL, seq_len))            # log-probs, logits
    assert_fp32_close(got, want, gpt_terms(MODEL, seq_len, grad_tokens=n))     # gradients
    tol = weight_tol(lr, num_terms, grad_max_per_step, want)          # weights after Adam steps

Two fp32 runs of one computation that differ only in the order of its sums (a reduction split
over TP/CP/DP ranks, other micro-batch shapes, another CPU's GEMM blocking) each carry a rounding
error of at most (n - 1)·u·Σ|x_i| for a sum of n terms x_i, in any order (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., eq. 4.4), u = 2^-24 the fp32 unit roundoff: they
differ by at most twice that (``fp32_tol``). A value made by a chain of sums (a forward pass, a
backward pass) takes for n the chain's summed accumulation lengths (``gpt_terms``): to first
order the relative errors of the stages add, each stage being well conditioned (norms and
softmaxes keep activations O(1)). ``scale`` stands for Σ|x_i|: the magnitude of the compared
values (the largest |entry| of the reference tensor, of one parameter's gradient), not of each
entry: an entry summing terms that cancel is small, its rounding is not.

These are worst-case bounds: the differences observed between AVX-512, AVX2 and SSE kernels
(``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``) are 1e-4 to 2e-2 of them (up to 0.12 for
weights after Adam steps, whose bound is mostly the last-bit rounding of each weight), while the
bugs the tests look for (a wrong reduction, normaliser, mask or position) move values by a good
fraction of their magnitude: tens to thousands of times the bound.

Adam (``adam_weight_tol``): its step lr·m̂/(√v̂ + eps) has slope up to lr/eps in the gradient,
1e5·lr at the default eps = 1e-8, so on entries whose gradient is within rounding of 0 a
rounding difference moves the weight by up to 2·lr per step: no tolerance below that holds on
every machine. The tests that compare weights after optimizer steps run Adam with
``ADAM_EPS``, where the slope is at most lr/ADAM_EPS and the bound a small fraction of a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_earl.config.model import ModelConfig
    from megatron_earl.redistribute.geometry import ShardPiece

U_FP32 = 2.0**-24
"""fp32 unit roundoff (half the spacing of the floats in [1, 2))."""

ADAM_EPS = 1e-2
"""Adam's eps in the tests that compare weights after optimizer steps: far above the rounding
bound of every gradient entry here (``fp32_tol`` of a few thousand terms: < 4e-4 x max|g| <=
4e-5), so the update is a Lipschitz function of the gradient with slope <= lr/ADAM_EPS
(``adam_weight_tol``); entries with |g| above it still step by ~lr, the others by lr·|g|/eps."""


def fp32_tol(num_terms: int, scale: float) -> float:
    """Bound on |a - b| for two fp32 evaluations, in different summation orders, of a (chain of)
    sum(s) of ``num_terms`` terms whose absolute values sum to at most ``scale``."""
    return 2 * num_terms * U_FP32 * scale


def assert_fp32_close(
    actual: torch.Tensor, expected: torch.Tensor, num_terms: int, msg: str | None = None
) -> None:
    """``assert_close`` within ``fp32_tol(num_terms, max |expected|)``, absolute (no rtol)."""
    atol = fp32_tol(num_terms, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=msg)


def gpt_terms(model: ModelConfig, seq_len: int, grad_tokens: int = 0) -> int:
    """Accumulation length of a GPT forward for one token attending to ``seq_len`` tokens: per
    layer the two norms (hidden each, and head_dim each for q/k norms), qkv (hidden), the scores
    (head_dim), the softmax and P·V (seq_len each), the output projection (heads·head_dim), fc1
    (hidden) and fc2 (ffn) -- for a mixture of experts the router (hidden), its softmax (the
    experts), an expert's fc1 (hidden) and fc2 (its ffn), the top-k combine and a shared expert's
    fc2; then the final norm and the output layer (hidden each) and the
    log-softmax and entropy (the padded vocabulary each). With ``grad_tokens`` > 0: a weight's
    gradient summed over that many tokens (the forward, the backward's mirror chain, the sum)."""
    h, d = model.hidden_size, model.head_dim
    norms = 2 * h + (2 * d if model.qk_layernorm else 0)
    attention = h + d + 2 * seq_len + model.num_attention_heads * d
    mlp = h + model.ffn_hidden_size
    if model.is_moe:
        mlp = h + model.num_experts + h + model.expert_ffn_hidden_size + model.moe_router_topk
        mlp += model.moe_shared_expert_intermediate_size or 0
    layer = norms + attention + mlp
    forward = model.num_layers * layer + 2 * h + 2 * model.padded_vocab_size
    return forward if grad_tokens == 0 else 2 * forward + grad_tokens


def adam_weight_tol(
    lr: float, grad_tols: Sequence[float], max_weight: float, eps: float = ADAM_EPS
) -> float:
    """Bound on |w_a - w_b| after ``len(grad_tols)`` Adam steps (bias-corrected, constant lr, no
    weight decay) from the same weights and state, step k's gradients differing by at most
    ``grad_tols[k]``.

    m̂_k and √v̂_k are weighted means (weights summing to 1) of steps 1..k's gradients and of their
    squares, so they move by <= d_k = max(grad_tols[:k + 1]); the update lr·m̂/(√v̂ + eps) has
    slope <= lr/eps in m̂ and lr·|m̂|/(√v̂ + eps)^2 <= 1.02·lr/eps in √v̂ (|m̂| <= 1.02·√v̂ over the
    first 5 steps): it moves by <= 2.05·lr·d_k/eps. Each run rounds w + update once per step
    (u·|w| each). First order: a later gradient's change with the earlier weight differences is
    left out."""
    total, worst = 0.0, 0.0
    for tol in grad_tols:
        worst = max(worst, tol)
        total += 2.05 * lr * worst / eps + 2 * U_FP32 * max_weight
    return total


def adam_loss_tol(loss: float, forward_terms: int, grad_terms: int, lr: float, steps: int) -> float:
    """Bound on the difference of a loss ``steps`` Adam steps (``ADAM_EPS``, clip_grad = 1) after
    two runs had the same weights: its forward's fp32 bound, plus per step ||g||·||dw|| with
    ||g|| <= 1 (the clip) and Adam's ||dw|| <= 2.05·lr/ADAM_EPS x the gradients' difference
    (``adam_weight_tol``), itself <= ``fp32_tol(grad_terms, 1)`` in norm."""
    per_step = 2.05 * lr / ADAM_EPS * fp32_tol(grad_terms, 1.0)
    return fp32_tol(forward_terms, abs(loss)) + steps * per_step


def weight_tol(
    lr: float, num_terms: int, grad_maxima: Sequence[float], weight: torch.Tensor
) -> float:
    """``adam_weight_tol`` for one parameter (``weight``: its reference values): step k's
    gradients differing by at most ``fp32_tol(num_terms, grad_maxima[k])``, the fp32 bound at the
    largest |entry| of its gradient at step k."""
    grad_tols = [fp32_tol(num_terms, g) for g in grad_maxima]
    return adam_weight_tol(lr, grad_tols, float(weight.abs().max()))


def grad_maxima(pieces: Iterable[ShardPiece]) -> dict[str, float]:
    """The largest |entry| of each parameter's gradient (``main_grad``, as the optimizer reads it)
    by global key (``redistribute.geometry.shard_pieces``), over this rank's pieces of it. Local:
    call it on the rank, after the step."""
    out: dict[str, float] = {}
    for p in pieces:
        grad = p.view_of(p.param.main_grad)
        out[p.key] = max(out.get(p.key, 0.0), float(grad.abs().max()) if grad.numel() else 0.0)
    return out
