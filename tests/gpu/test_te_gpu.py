"""Transformer Engine on CUDA: "auto" builds Megatron-Core's TE spec when TE is importable; TE's
context parallelism at CP2 (2 GPUs) gives the log-probs and gradients of CP1 (1 GPU) from the same
bf16 weights (tolerances below), with the bodies of tests/distributed/test_context_parallel.py.
Skipped without TE (``pip install -e ".[te]"``) or without the GPUs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_earl.compat.optional import has_transformer_engine
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from megatron_earl.testing.shards import assemble_regions
from tests.distributed import test_context_parallel as cpu
from tests.gpu import requires_gpus, to_host

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_transformer_engine(), reason='needs pip install -e ".[te]"'),
]
LOGPROB_TOL = 5e-2
"""bf16: TE's context-parallel attention runs on its flash/fused backends, which take 16-bit
inputs only; bf16 keeps 8 bits of mantissa (relative step 4e-3) and log-probs are O(5)."""
GRAD_REL_TOL = 2e-2
"""Relative error of each gradient tensor (norm of the difference / norm of the reference)."""
MODEL = dataclasses.replace(
    cpu.MODEL, transformer_impl="transformer_engine", params_dtype="bfloat16"
)


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
