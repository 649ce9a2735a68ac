"""Context parallelism without Transformer Engine (``ContextParallelSDPAttention``).

- CP2 (2 processes), TP2xCP2 and CP2xDP2 (4 processes): per-token log-probs and every gradient
  equal a single-process CP=1 reference built from the same weights (within the fp32 bounds of
  their sums in another order: ``tests/tolerances.py``), with a ragged loss mask (checks the loss
  normalisation over the CP group).
- Packed (thd) sequences, and an explicit attention mask, at CP2 equal CP=1 (the same bounds).
- A 16K-token sequence trains one optimizer step at CP=2 on 2 processes within 60 s and 4 GiB of
  peak RSS per rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from megatron_earl.testing.shards import assemble_regions
from tests.tolerances import assert_fp32_close, fp32_tol, gpt_terms

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=200,
    make_vocab_size_divisible_by=16,
    add_qkv_bias=True,
    attention_backend="sdpa",
)
SEQ_LEN = 48
FORWARD_TERMS = gpt_terms(MODEL, SEQ_LEN)
"""A log-prob's or the loss's chain of fp32 sums (~1.6e3 terms: ~2e-4 x its magnitude)."""
GRAD_TERMS = gpt_terms(MODEL, SEQ_LEN, grad_tokens=4 * 2 * SEQ_LEN)
"""A gradient's, over _batches' 4 micro-batches of 2 x 48 tokens (the most any test here sums:
~3.6e3 terms, ~4e-4 x the parameter's largest entry); a CP rank's keys left out of attention or a
loss normaliser over one CP rank moves them by O(their magnitude)."""


def _batches(seed: int = 5):
    from megatron_earl.training.step import synthetic_lm_batches

    batches = synthetic_lm_batches(
        MODEL.vocab_size, num_micro_batches=4, micro_batch_size=2, seq_length=SEQ_LEN, seed=seed
    )
    gen = torch.Generator().manual_seed(seed + 1)
    for b in batches:  # ragged mask: CP ranks hold different numbers of loss tokens
        b["loss_mask"] = (torch.rand(b["loss_mask"].shape, generator=gen) < 0.6).float()
    return batches


def _packed_batch(lengths: list[int], cp: int, seed: int = 9):
    """One packed (thd) micro-batch; every sequence padded to a multiple of 2 x cp."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_earl.parallel.cp import cp_padded_length

    gen = torch.Generator().manual_seed(seed)
    padded = [cp_padded_length(n, cp) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    cu_real = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    mask = torch.zeros(1, total)
    for start, n in zip(cu[:-1].tolist(), lengths, strict=True):
        mask[0, start : start + n] = 1.0
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real,
        cu_seqlens_kv=cu_real,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return {
        "tokens": torch.randint(0, MODEL.vocab_size, (1, total), generator=gen),
        "labels": torch.randint(0, MODEL.vocab_size, (1, total), generator=gen),
        "loss_mask": mask,
        "position_ids": torch.cat([torch.arange(n) for n in padded]).unsqueeze(0),
        "packed_seq_params": params,
    }


def _run(layout: ParallelLayout, model: ModelConfig, full_weights, batches, cu_padded=None):
    """Load the weights into ``layout``, split each micro-batch for this CP rank, forward-backward;
    return this rank's log-probs (local CP order) and gradient pieces."""
    from megatron.core import parallel_state

    from megatron_earl import runtime
    from megatron_earl.config.optim import OptimConfig
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.cp import split_batch_for_cp
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
    chunks = build_model(model)
    if full_weights is None:
        full_weights = full_state_dict(chunks)
    load_full_state_dict(chunks, full_weights)
    ddp = wrap_ddp(chunks, OptimConfig())
    wire_schedule_hooks(ddp)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    mine = [
        split_batch_for_cp(b, layout.cp, cp_rank, cu_seqlens_padded=cu_padded)
        for b in batches[dp_rank::dp]
    ]
    metrics = forward_backward(ddp, mine, forward_only=False)
    grads = [
        (p.key, p.global_shape, p.region, p.view_of(p.param.main_grad).clone())
        for p in shard_pieces(chunks)
    ]
    return {
        "weights": full_weights,
        "logprobs": [m["logprobs"] for m in metrics],
        "losses": [float(m["loss"]) for m in metrics],
        "grads": grads,
        "dp_rank": dp_rank,
        "cp_rank": cp_rank,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "core": type(chunks[0].decoder.layers[0].self_attention.core_attention).__name__,
    }


def _check(reference, results, layout: ParallelLayout, cu_padded=None):
    from megatron_earl.parallel.cp import merge_cp_shards

    assert {r["core"] for r in results} == {"ContextParallelSDPAttention"}
    ref_lp = reference["logprobs"]
    for dp_rank in range(layout.dp):
        ranks = sorted(
            (r for r in results if r["dp_rank"] == dp_rank and r["tp_rank"] == 0),
            key=lambda r: r["cp_rank"],
        )
        assert [r["cp_rank"] for r in ranks] == list(range(layout.cp))
        for i in range(len(ranks[0]["logprobs"])):
            merged = merge_cp_shards([r["logprobs"][i] for r in ranks], cu_seqlens_padded=cu_padded)
            assert_fp32_close(merged, ref_lp[dp_rank + i * layout.dp], FORWARD_TERMS)
            for r in ranks:  # the loss metric is the whole micro-batch's, on every CP rank
                want = reference["losses"][dp_rank + i * layout.dp]
                assert abs(r["losses"][i] - want) <= fp32_tol(FORWARD_TERMS, abs(want))
    ref_grads = assemble_regions([reference["grads"]])
    for res in results:  # every rank's gradient pieces equal the reference's regions
        got = assemble_regions([res["grads"]]) if layout.tp == 1 else None
        if got is not None:
            for key, full in got.items():
                assert_fp32_close(full, ref_grads[key], GRAD_TERMS, msg=key)
    got = assemble_regions(r["grads"] for r in results)
    assert set(got) == set(ref_grads)
    for key, full in got.items():
        assert_fp32_close(full, ref_grads[key], GRAD_TERMS, msg=key)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(
        _run, 1, args=(ParallelLayout(), MODEL, None, _batches()), timeout_s=180
    )[0]


@pytest.mark.parametrize(
    ("layout", "world"),
    [
        (ParallelLayout(cp=2), 2),
        (ParallelLayout(tp=2, cp=2), 4),
        (ParallelLayout(cp=2, dp=2), 4),
    ],
    ids=lambda v: str(v) if isinstance(v, ParallelLayout) else None,
)
def test_cp_logprobs_and_grads_match_single_process(reference, layout, world):
    results = run_distributed(
        _run, world, args=(layout, MODEL, reference["weights"], _batches()), timeout_s=240
    )
    _check(reference, results, layout)


def test_cp_packed_sequences_match_single_process():
    lengths = [13, 30, 5]  # padded to 16, 32, 8 at cp=2
    batch = _packed_batch(lengths, cp=2)
    cu = batch["packed_seq_params"].cu_seqlens_q_padded
    (ref,) = run_distributed(_run, 1, args=(ParallelLayout(), MODEL, None, [batch]), timeout_s=180)
    results = run_distributed(
        _run, 2, args=(ParallelLayout(cp=2), MODEL, ref["weights"], [batch], cu), timeout_s=180
    )
    _check(ref, results, ParallelLayout(cp=2), cu_padded=cu)


def test_cp_explicit_attention_mask_matches_single_process():
    """A Megatron attention mask (True = masked) [b, 1, s, s]: CP ranks keep their query rows."""
    batches = _batches(seed=11)[:2]
    pos = torch.arange(SEQ_LEN)
    for b in batches:  # causal, and every query past position 5 also skips keys 1..3
        extra = (pos[:, None] > 5) & (pos[None, :] >= 1) & (pos[None, :] <= 3)
        b["attention_mask"] = ((pos[None, :] > pos[:, None]) | extra).expand(2, 1, -1, -1)
    (ref,) = run_distributed(_run, 1, args=(ParallelLayout(), MODEL, None, batches), timeout_s=180)
    results = run_distributed(
        _run, 2, args=(ParallelLayout(cp=2), MODEL, ref["weights"], batches), timeout_s=180
    )
    _check(ref, results, ParallelLayout(cp=2))


LONG_SEQ = 16384
LONG_TIME_BOUND_S = 60.0
LONG_RSS_BOUND_GIB = 4.0


def _train_long(seq_len: int):
    import resource
    import time

    from megatron.core import parallel_state

    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.cp import split_batch_for_cp
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.training.setup import (
        OptimConfig,
        build_optimizer,
        wire_schedule_hooks,
        wrap_ddp,
    )
    from megatron_earl.training.step import synthetic_lm_batches, train_step

    model = dataclasses.replace(
        MODEL,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=2,
        num_query_groups=1,
        vocab_size=128,
        max_position_embeddings=seq_len,
    )
    layout = ParallelLayout(cp=2)
    initialize_layout(layout)
    runtime.seed(3)
    start = time.perf_counter()
    ddp = wrap_ddp(build_model(model), OptimConfig())
    optimizer = build_optimizer(ddp, OptimConfig())
    wire_schedule_hooks(ddp, optimizer)
    cp_rank = parallel_state.get_context_parallel_rank()
    batches = [
        split_batch_for_cp(b, 2, cp_rank)
        for b in synthetic_lm_batches(model.vocab_size, 1, 1, seq_len, seed=0)
    ]
    before = [p.detach().clone() for p in ddp[0].parameters()]
    out = train_step(ddp, optimizer, batches)
    changed = any(not torch.equal(a, p) for a, p in zip(before, ddp[0].parameters(), strict=True))
    return {
        "seconds": time.perf_counter() - start,
        "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "local_tokens": int(batches[0]["tokens"].numel()),
        "changed": changed,
        **out,
    }


def test_16k_sequence_trains_a_step_at_cp2():
    results = run_distributed(_train_long, 2, args=(LONG_SEQ,), timeout_s=180)
    for res in results:
        assert res["local_tokens"] == LONG_SEQ // 2
        assert res["update_ok"] and res["changed"]
        assert 4.0 < res["loss"] < 6.0  # ~ln(128) = 4.85 for random tokens
        assert res["seconds"] < LONG_TIME_BOUND_S, res
        assert res["max_rss_gib"] < LONG_RSS_BOUND_GIB, res
