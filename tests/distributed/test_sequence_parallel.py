"""Sequence parallelism (``model.sequence_parallel``): at tp 2, and at tp 2 x cp 2, two RL train
steps give the same updated parameters and metrics as one process on the same data (within the
fp32 bounds of ``tests/tolerances.py``), and so do the forward-only log-probs and (at cp 1, where
it generates) the embedded engine's logits; the
sequence really is split (the final norm sees 1/tp of each CP rank's tokens) and the norms'
gradients are summed over TP; a micro-batch not padded for it fails with its token count and tp
named, on every rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_rl_step import (
    LENGTHS,
    MODEL,
    _config,
    _samples,
    _setup,
    assert_matches_reference,
)
from tests.tolerances import fp32_tol, gpt_terms, grad_maxima, weight_tol

# qk-layernorm and a qkv bias too: every kind of parameter whose gradient TP must reduce.
SP_MODEL = dataclasses.replace(MODEL, sequence_parallel=True, qk_layernorm=True, add_qkv_bias=True)
PROMPTS = ((5, 9, 2, 17, 33, 4, 8), (7, 1, 60))
SP_TERMS = gpt_terms(SP_MODEL, max(LENGTHS), grad_tokens=sum(LENGTHS))
"""A gradient's chain of fp32 sums (``test_rl_step.NUM_TERMS`` with the q/k norms)."""
TOL = fp32_tol(SP_TERMS, 1.0)
"""Metrics, relative to max(1, |value|) (as ``test_rl_step.TOL``)."""
FORWARD_TERMS = gpt_terms(SP_MODEL, 32)
"""A log-prob's or an engine logit's chain of sums (sequences <= 32 tokens)."""


def forward_tol(want: torch.Tensor) -> float:
    """Log-probs and logits: the forward's fp32 bound at their magnitude (~2e-4 x it); an
    unreduced or misplaced sequence shard moves them by O(their magnitude)."""
    return fp32_tol(FORWARD_TERMS, float(want.abs().max()))


def _engine_logits(chunks) -> list[torch.Tensor]:
    """Prefill of two prompts, then one decode step, on the embedded engine's batched forward."""
    from megatron_earl.rollout.embedded.batched_forward import BatchedForward
    from megatron_earl.rollout.embedded.step import Batch

    forward = BatchedForward(chunks[0], max_batch_size=2, max_seq_len=32)
    prefill = forward(Batch(rows=(0, 1), tokens=PROMPTS, starts=(0, 0)))
    decode = forward(Batch.decode(lengths=[len(p) for p in PROMPTS], tokens=[11, 12]))
    return [prefill, decode]


def _run(layout: ParallelLayout, weights, model=SP_MODEL):
    from megatron.core import parallel_state

    from megatron_earl.parallel.ddp import unwrap_chunk
    from megatron_earl.redistribute.geometry import full_state_dict, shard_pieces
    from megatron_earl.training.rl_step import forward_logprobs, rl_train_step

    chunks, ddp, optimizer, weights = _setup(layout, weights, model)
    gpt = unwrap_chunk(chunks[0])
    sp_on = gpt.config.sequence_parallel
    norm_tokens = []
    hook = gpt.decoder.final_layernorm.register_forward_hook(
        lambda _m, args, _out: norm_tokens.append(args[0].size(0))
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = _samples()[dp_rank :: layout.dp]
    budget = _config().max_tokens_per_micro_batch
    with torch.no_grad():
        logprobs, _ = forward_logprobs(chunks, mine, max_tokens=budget, entropy=False)
    inputs_tokens = _local_input_tokens(mine, budget, layout, sp_on)
    hook.remove()
    # the embedded engine generates at cp = 1 only (batched_forward.check_supported)
    engine = [t.clone() for t in _engine_logits(chunks)] if layout.cp == 1 else None
    metrics, grads = [], []
    for _ in range(2):
        metrics.append(rl_train_step(ddp, optimizer, mine, _config()))
        grads.append(grad_maxima(shard_pieces(chunks)))
    params = [(p.key, p.region, p.local.detach().clone()) for p in shard_pieces(chunks)]
    marked = sorted(n for n, p in gpt.named_parameters() if getattr(p, "sequence_parallel", False))
    return {
        "weights": weights,
        "metrics": metrics,
        "grad_max": grads,
        "params": params,
        "final": full_state_dict(chunks) if layout.world_size == 1 else None,
        "logprobs": logprobs,
        "engine": engine,
        "sp_on": sp_on,
        "norm_tokens": norm_tokens,
        "input_tokens": inputs_tokens,
        "marked": marked,
    }


def _local_input_tokens(samples, budget, layout, sp_on) -> list[int]:
    """Tokens per micro-batch on this CP rank, as the train step packs them."""
    from megatron_earl.training.microbatch import build_micro_batches

    sp = layout.tp if sp_on else 1
    return [
        mb["tokens"].size(1) // layout.cp
        for mb in build_micro_batches(samples, budget, layout.cp, sp)
    ]


@pytest.fixture(scope="module")
def reference():
    (res,) = run_distributed(_run, 1, args=(ParallelLayout(), None), timeout_s=180)
    return res


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2), ParallelLayout(tp=2, cp=2)], ids=str)
def test_sequence_parallel_equals_single_process(reference, layout):

    assert not reference["sp_on"]  # tp = 1: Megatron's sequence parallelism stays off
    results = run_distributed(
        _run, layout.world_size, args=(layout, reference["weights"]), timeout_s=300
    )
    for res in results:
        assert res["sp_on"]
        # the sequence is split: the final norm saw 1/tp of each micro-batch's local tokens
        assert res["norm_tokens"] == [n // layout.tp for n in res["input_tokens"]]
        assert "decoder.final_layernorm.weight" in res["marked"]
        assert "decoder.layers.0.input_layernorm.weight" in res["marked"]
        assert not any("q_layernorm" in n or "k_layernorm" in n for n in res["marked"])
        assert_matches_reference(res, reference, SP_TERMS)
        for got, want in zip(res["logprobs"], reference["logprobs"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=forward_tol(want))
        for got, want in zip(res["engine"] or [], reference["engine"], strict=False):
            torch.testing.assert_close(got, want, rtol=0, atol=forward_tol(want))


def _unpadded_micro_batch():
    from megatron_earl.training.microbatch import thd_micro_batch
    from megatron_earl.training.rl_step import train_micro_batches

    _, ddp, optimizer, _ = _setup(ParallelLayout(tp=2), None, SP_MODEL)
    sample = _samples()[0]  # 9 tokens: not a multiple of tp = 2
    whole = [thd_micro_batch(sample, [sample["tokens"].numel()])]
    try:
        train_micro_batches(ddp, optimizer, whole, _config())
    except ValueError as err:
        return str(err)
    return None


def test_unpadded_micro_batch_fails_naming_tokens_and_tp():
    for message in run_distributed(_unpadded_micro_batch, 2, timeout_s=180):
        assert message is not None
        assert "holds 9 tokens" in message and "tp = 2" in message and "sp=2" in message


def _loop_step(sequence_parallel: bool):
    """One RLLoop experience + train step in tp 2 (old log-probs always computed), on the same
    batch and seed, with or without sequence parallelism."""
    import torch.distributed as dist

    from megatron_earl.config import load_config
    from megatron_earl.orchestration.loop import RLLoop
    from megatron_earl.redistribute.geometry import shard_pieces
    from megatron_earl.tokenizer import build_tokenizer
    from tests.distributed.test_old_logprobs import _batch, _overrides

    config = load_config(
        overrides=[
            *_overrides("tp2cp1pp1dp1"),
            "train.old_logprobs=always",
            f"model.sequence_parallel={str(sequence_parallel).lower()}",
        ]
    )
    loop = RLLoop(config, build_tokenizer(config.tokenizer))
    after = loop.experience(_batch(dist.get_rank()))
    metrics = dict(loop.train(after))
    chunks = loop.policy.ddp_chunks
    pieces = shard_pieces(chunks)
    return {
        "sp_on": chunks[0].config.sequence_parallel,
        "old_logprobs": after.token_fields["old_logprobs"].clone(),
        "metrics": metrics,
        "weights": {(p.key, p.region): p.local.detach().clone() for p in pieces},
        "grad_max": grad_maxima(pieces),
        "model": config.model,
        "lr": config.train.lr,
    }


def _loop_both():
    return {sp: _loop_step(sp) for sp in (False, True)}


def test_rl_loop_with_sequence_parallel_equals_without():
    """The RL loop pads the dispatched micro-batches for it (odd sample lengths) and the old
    log-probs, the train metrics and the updated weights equal the run without it (within the
    fp32 bounds of their sums in the other order: ``tests/tolerances.py``)."""
    from tests.distributed.test_old_logprobs import LENGTHS as LOOP_LENGTHS

    for res in run_distributed(_loop_both, 2, timeout_s=300):
        off, on = res[False], res[True]
        assert on["sp_on"] and not off["sp_on"]
        terms = gpt_terms(off["model"], max(LOOP_LENGTHS), grad_tokens=sum(LOOP_LENGTHS))
        want_lp = off["old_logprobs"]
        lp_tol = fp32_tol(gpt_terms(off["model"], max(LOOP_LENGTHS)), float(want_lp.abs().max()))
        torch.testing.assert_close(on["old_logprobs"], want_lp, rtol=0, atol=lp_tol)
        metric_tol = fp32_tol(terms, 1.0)  # relative, as TOL
        for key in ("loss", "pg_loss", "grad_norm", "entropy", "num_tokens", "logprob_mismatch"):
            got, want = on["metrics"][key], off["metrics"][key]
            assert got == pytest.approx(want, rel=metric_tol, abs=metric_tol), key
        assert off["metrics"]["grad_norm"] > 0
        for key, value in off["weights"].items():
            tol = weight_tol(off["lr"], terms, [off["grad_max"][key[0]]], value)
            torch.testing.assert_close(on["weights"][key], value, rtol=0, atol=tol, msg=str(key))
