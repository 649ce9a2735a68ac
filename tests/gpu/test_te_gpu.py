"""Transformer Engine on CUDA: "auto" builds Megatron-Core's TE spec when TE is importable; TE's
context parallelism at CP2 (2 GPUs) gives the log-probs and gradients of CP1 (1 GPU) from the same
bf16 weights (tolerances below), with the bodies of tests/distributed/test_context_parallel.py;
TE with TP2 and sequence parallelism (2 GPUs) gives the log-probs and one RL train step (its
gradients, gradient norm and token count) of TP1 (1 GPU), as tests/distributed/
test_sequence_parallel.py checks on the local spec, and really splits the sequence. Skipped
without the ``transformer_engine`` package (``pip install -e ".[te]"``) or without the GPUs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_earl.compat.optional import has_transformer_engine
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from megatron_earl.testing.shards import assemble_regions
from tests.distributed import test_context_parallel as cpu
from tests.distributed import test_rl_step as rl
from tests.distributed import test_sequence_parallel as sp
from tests.gpu import requires_gpus, to_host

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not has_transformer_engine(),
        reason='needs the transformer_engine package (pip install -e ".[te]")',
    ),
]
LOGPROB_TOL = 5e-2
"""bf16: TE's context-parallel attention runs on its flash/fused backends, which take 16-bit
inputs only; bf16 keeps 8 bits of mantissa (relative step 4e-3) and log-probs are O(5)."""
GRAD_REL_TOL = 2e-2
"""Relative error of each gradient tensor (norm of the difference / norm of the reference):
bf16 rounds every GEMM output and every TP/CP exchange (unit roundoff u = 2^-9 ~ 2e-3); the
2-layer models here chain ~12 such roundings from the loss to a weight's gradient, independent
between the two runs: ~sqrt(12) x 2 x u ~ 1.4e-2 in norm at most typical, below this; a wrong
reduction or a missing shard moves a gradient by O(its norm)."""
MODEL = dataclasses.replace(
    cpu.MODEL, transformer_impl="transformer_engine", params_dtype="bfloat16"
)
SP_MODEL = dataclasses.replace(
    sp.SP_MODEL, transformer_impl="transformer_engine", params_dtype="bfloat16"
)
"""test_sequence_parallel's model (qk-layernorm, qkv bias, sequence parallel) on TE in bf16: TE's
fused/flash attention takes the packed (thd) micro-batches of the RL step in 16-bit only."""


def _run_on_host(layout, model, weights, batches):
    return to_host(cpu._run(layout, model, weights, batches))


def _auto_impl():
    from megatron_earl.config.model import ModelConfig
    from megatron_earl.models.impl import machine_transformer_impl, pin_transformer_impl

    auto = ModelConfig()
    return (
        str(machine_transformer_impl(auto)),
        str(pin_transformer_impl(auto, embedded_engine=True).transformer_impl),
    )


@requires_gpus(1)
def test_auto_is_transformer_engine_on_cuda_and_local_for_the_embedded_engine():
    (impls,) = run_distributed(_auto_impl, 1, timeout_s=120)
    assert impls == ("transformer_engine", "local")


@requires_gpus(2)
def test_te_context_parallel_matches_one_gpu():
    (ref,) = run_distributed(
        _run_on_host, 1, args=(ParallelLayout(), MODEL, None, cpu._batches()), timeout_s=300
    )
    assert ref["core"] == "TEDotProductAttention"
    results = run_distributed(
        _run_on_host,
        2,
        args=(ParallelLayout(cp=2), MODEL, ref["weights"], cpu._batches()),
        timeout_s=300,
    )
    from megatron_earl.parallel.cp import merge_cp_shards

    ranks = sorted(results, key=lambda r: r["cp_rank"])
    assert {r["core"] for r in ranks} == {"TEDotProductAttention"}
    for i, want in enumerate(ref["logprobs"]):
        merged = merge_cp_shards([r["logprobs"][i] for r in ranks])
        torch.testing.assert_close(merged.float(), want.float(), rtol=0, atol=LOGPROB_TOL)
    ref_grads = assemble_regions([ref["grads"]])
    got = assemble_regions(r["grads"] for r in results)
    assert set(got) == set(ref_grads)
    for key, full in got.items():
        want = ref_grads[key].float()
        err = (full.float() - want).norm() / want.norm().clamp_min(1e-12)
        assert err <= GRAD_REL_TOL, (key, float(err))


def _sp_step(layout: ParallelLayout, weights):
    """Forward-only log-probs of test_rl_step's samples, then one RL train step, in ``layout``;
    the tokens the final norm saw per micro-batch of the forward, and this rank's gradients
    (``main_grad`` after the step: clipped in place by the optimizer, as on every rank)."""
    from megatron.core import parallel_state

    from megatron_earl.parallel.ddp import unwrap_chunk
    from megatron_earl.redistribute.geometry import shard_pieces
    from megatron_earl.training.rl_step import forward_logprobs, rl_train_step

    chunks, ddp, optimizer, weights = rl._setup(layout, weights, SP_MODEL)
    gpt = unwrap_chunk(chunks[0])
    norm_tokens: list[int] = []
    hook = gpt.decoder.final_layernorm.register_forward_hook(
        lambda _m, args, _out: norm_tokens.append(args[0].size(0))
    )
    mine = rl._samples()[parallel_state.get_data_parallel_rank() :: layout.dp]
    budget = rl._config().max_tokens_per_micro_batch
    with torch.no_grad():
        logprobs, _ = forward_logprobs(chunks, mine, max_tokens=budget, entropy=False)
    hook.remove()
    sp_on = gpt.config.sequence_parallel
    metrics = rl_train_step(ddp, optimizer, mine, rl._config())
    grads = [
        (p.key, p.global_shape, p.region, p.view_of(p.param.main_grad).float().clone())
        for p in shard_pieces(chunks)
    ]
    core = gpt.decoder.layers[0].self_attention.core_attention
    return to_host(
        {
            "weights": weights,
            "logprobs": logprobs,
            "metrics": metrics,
            "grads": grads,
            "sp_on": sp_on,
            "norm_tokens": norm_tokens,
            "input_tokens": sp._local_input_tokens(mine, budget, layout, sp_on),
            "core": type(core).__name__,
        }
    )


@requires_gpus(2)
def test_te_tensor_and_sequence_parallel_matches_one_gpu():
    (ref,) = run_distributed(_sp_step, 1, args=(ParallelLayout(), None), timeout_s=300)
    assert ref["core"] == "TEDotProductAttention" and not ref["sp_on"]  # tp 1: SP stays off
    layout = ParallelLayout(tp=2)
    results = run_distributed(_sp_step, 2, args=(layout, ref["weights"]), timeout_s=300)
    for res in results:
        assert res["core"] == "TEDotProductAttention" and res["sp_on"]
        # the sequence is split: the final norm saw 1/tp of each micro-batch's tokens
        assert res["norm_tokens"] == [n // layout.tp for n in res["input_tokens"]]
        for got, want in zip(res["logprobs"], ref["logprobs"], strict=True):
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=LOGPROB_TOL)
        got_m, want_m = res["metrics"], ref["metrics"]
        assert got_m["num_tokens"] == want_m["num_tokens"]
        assert got_m["update_ok"] == 1 and got_m["skipped_step"] == 0
        # the norm of all gradients: its relative error is at most the largest tensor's
        assert abs(got_m["grad_norm"] - want_m["grad_norm"]) <= GRAD_REL_TOL * want_m["grad_norm"]
    ref_grads = assemble_regions([ref["grads"]])
    got = assemble_regions(r["grads"] for r in results)
    assert set(got) == set(ref_grads)
    for key, full in got.items():
        want = ref_grads[key]
        err = (full - want).norm() / want.norm().clamp_min(1e-12)
        # x2: each run's clip coefficient (1 / its gradient norm) scaled main_grad in place,
        # and the two norms differ by up to GRAD_REL_TOL relative
        assert err <= 2 * GRAD_REL_TOL, (key, float(err))
