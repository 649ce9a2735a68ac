"""TP=2, PP=2 (1F1B and interleaved), DP=2 and TP2xPP2 log-probs and gradients equal a
single-process TP=1 reference built from the same weights (within the fp32 bounds of their sums in
another order: ``tests/tolerances.py``)."""

from __future__ import annotations

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from megatron_earl.testing.shards import assemble_regions
from tests.tolerances import assert_fp32_close, gpt_terms

MODEL = ModelConfig(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=200,
    make_vocab_size_divisible_by=16,
    add_qkv_bias=True,
)
SEQ, NUM_TOKENS = 24, 4 * 2 * 24  # _batches: 4 micro-batches of 2 x 24
FORWARD_TERMS = gpt_terms(MODEL, SEQ)
"""A log-prob's chain of fp32 sums (~2.5e3 terms: ~3e-4 x |log-prob|)."""
GRAD_TERMS = gpt_terms(MODEL, SEQ, grad_tokens=NUM_TOKENS)
"""A gradient's (~5e3 terms: ~6e-4 x the parameter's largest entry); a missing TP/DP reduction
or a micro-batch lost in the pipeline moves gradients by O(their magnitude)."""


def _batches(seed: int = 3):
    from megatron_earl.training.step import synthetic_lm_batches

    return synthetic_lm_batches(
        MODEL.vocab_size, num_micro_batches=4, micro_batch_size=2, seq_length=SEQ, seed=seed
    )


def _run(layout: ParallelLayout, model: ModelConfig, full_weights, batches):
    """Load the weights into ``layout``, forward-backward, return log-probs and grad pieces."""
    from megatron.core import parallel_state

    from megatron_earl import runtime
    from megatron_earl.config.optim import OptimConfig
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import (
        full_state_dict,
        load_full_state_dict,
        shard_pieces,
    )
    from megatron_earl.training.schedule import forward_backward
    from megatron_earl.training.setup import wire_schedule_hooks, wrap_ddp

    initialize_layout(layout)
    runtime.seed(1234)
    chunks = build_model(model, vpp=layout.vpp)
    if full_weights is None:
        full_weights = full_state_dict(chunks)
    load_full_state_dict(chunks, full_weights)
    ddp = wrap_ddp(chunks, OptimConfig())
    wire_schedule_hooks(ddp)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    mine = batches[dp_rank::dp]
    metrics = forward_backward(ddp, mine, forward_only=False)
    logprobs = [m["logprobs"] for m in metrics]
    grads = [
        (p.key, p.global_shape, p.region, p.view_of(p.param.main_grad).clone())
        for p in shard_pieces(chunks)
        if not p.is_replica
    ]
    return {
        "weights": full_weights,
        "logprobs": logprobs,
        "grads": grads,
        "dp_rank": dp_rank,
        "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
    }


@pytest.fixture(scope="module")
def reference():
    return run_distributed(
        _run, 1, args=(ParallelLayout(), MODEL, None, _batches()), timeout_s=180
    )[0]


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(tp=2),
        ParallelLayout(pp=2),
        ParallelLayout(pp=2, vpp=2),
        ParallelLayout(dp=2),
        ParallelLayout(tp=2, pp=2),
    ],
    ids=str,
)
def test_logprobs_and_grads_match_single_process(reference, layout):
    results = run_distributed(
        _run,
        layout.world_size,
        args=(layout, MODEL, reference["weights"], _batches()),
        timeout_s=240,
    )
    # Log-probs: micro-batch i of DP rank d is global micro-batch d + i * dp.
    ref_lp = reference["logprobs"]
    for res in results:
        if not res["last_stage"]:
            assert res["logprobs"] == []
            continue
        for i, lp in enumerate(res["logprobs"]):
            assert_fp32_close(lp, ref_lp[res["dp_rank"] + i * layout.dp], FORWARD_TERMS)
    # Gradients: every region of every global tensor, reassembled from the ranks' pieces.
    ref_grads = assemble_regions([reference["grads"]])
    got = assemble_regions(r["grads"] for r in results)
    assert set(got) == set(ref_grads)
    for key, full in got.items():
        assert_fp32_close(full, ref_grads[key], GRAD_TERMS, msg=key)
