"""Skipping the old-log-prob pass on an on-policy step (``train.old_logprobs: auto``), on 2 gloo
ranks, experience and train in tp2, dp2 or cp2: two ``RLLoop``s built from the same seed (the same
weights), one with ``train.old_logprobs=always``, take one step on the same batch.

- ``auto``: the experience phase returns the batch unchanged (no ``old_logprobs``, no dispatch);
  ``always``: it adds ``old_logprobs``;
- the train step's loss, pg_loss, grad norm and entropy agree and the ratio is 1 either way (its
  extremes exactly 1 without the pass);
- ``rollout/logprob_mismatch`` from the train forward (auto) equals the one from the experience
  pass's ``old_logprobs`` (always), and so do the other rollout metrics;
- the updated weights (this rank's shards) agree.

"Agree": within the fp32 bounds of ``tests/tolerances.py`` (a separate forward gives the old
log-probs the same sums, maybe in another order).

Run: python -m pytest -q tests/distributed/test_old_logprobs.py
"""

from __future__ import annotations

import pytest
import torch

from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import ADAM_EPS, fp32_tol, gpt_terms, grad_maxima, weight_tol

LENGTHS = [11, 17, 6, 23, 9, 14]


def _overrides(layout: str) -> list[str]:
    return [
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.ffn_hidden_size=128",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.vocab_size=320",
        "model.make_vocab_size_divisible_by=64",
        "layouts.rollout=tp1cp1pp1dp2",
        f"layouts.experience={layout}",
        f"layouts.train={layout}",
        "batch.prompts_per_step=3",
        "batch.samples_per_prompt=2",
        "batch.max_tokens_per_micro_batch=48",
        "rollout.max_context=64",
        "rollout.max_concurrency=4",
        "rollout.sampling.max_new_tokens=16",
        "train.lr=1e-2",
        # Adam's slope in the gradient is <= lr / eps: bounded weight tolerances (tolerances.py)
        f"train.adam_eps={ADAM_EPS}",
        "train.loss.tis_cap=2.0",
    ]


def _batch(rank: int):
    """Rank 0 holds samples 0, 2, 4; rank 1 samples 1, 3, 5 (two rollout sources); the rollout
    log-probs are noise around the model's, so the mismatch is far from 0."""
    from megatron_earl.dispatch import Batch
    from megatron_earl.training.microbatch import next_token_sample

    gen = torch.Generator().manual_seed(5)
    samples = []
    for n in LENGTHS:
        s = next_token_sample(
            torch.randint(0, 320, (n,), generator=gen),
            torch.arange(n) >= n // 3,
            rollout_logprobs=-5.8 + 0.3 * torch.randn(n, generator=gen),
        )
        s["advantages"] = torch.randn(1, generator=gen).expand(n) * s["loss_mask"]
        samples.append(s)
    mine = list(range(rank, len(LENGTHS), 2))
    names = ("tokens", "labels", "loss_mask", "rollout_logprobs", "advantages")
    return Batch(
        [1000 * rank + i for i in mine],
        [LENGTHS[i] for i in mine],
        {k: torch.cat([samples[i][k] for i in mine]) for k in names},
        {
            "reward": torch.zeros(len(mine)),
            "policy_version": torch.zeros(len(mine), dtype=torch.int64),
        },
        group_ids=[i // 2 for i in mine],
    )


def _step(layout: str, mode: str):
    import torch.distributed as dist

    from megatron_earl.config import load_config
    from megatron_earl.orchestration.loop import RLLoop
    from megatron_earl.orchestration.step_metrics import rollout_metrics
    from megatron_earl.redistribute.geometry import shard_pieces
    from megatron_earl.tokenizer import build_tokenizer

    config = load_config(overrides=[*_overrides(layout), f"train.old_logprobs={mode}"])
    loop = RLLoop(config, build_tokenizer(config.tokenizer))
    batch = _batch(dist.get_rank())
    after = loop.experience(batch)
    fields = sorted(after.token_fields)
    unchanged = after is batch
    metrics = dict(loop.train(after))
    mismatch = metrics.pop("logprob_mismatch")
    rollout = rollout_metrics([], after, config.rollout.max_turns, mismatch)
    pieces = shard_pieces(loop.policy.ddp_chunks)
    return {
        "fields": fields,
        "unchanged": unchanged,
        "metrics": metrics,
        "rollout": rollout,
        "weights": {(p.key, p.region): p.local.detach().clone() for p in pieces},
        "grad_max": grad_maxima(pieces),
        "model": config.model,
        "lr": config.train.lr,
    }


def _both(layout: str):
    """The always path, then the auto path, in the same processes (same seed: same weights)."""
    return {mode: _step(layout, mode) for mode in ("always", "auto")}


@pytest.mark.parametrize("layout", ["tp2cp1pp1dp1", "tp1cp1pp1dp2", "tp1cp2pp1dp1"])
def test_skipped_old_logprob_pass_equals_the_separate_pass(layout):
    results = run_distributed(_both, 2, args=(layout,), timeout_s=300)
    model, lr = results[0]["always"]["model"], results[0]["always"]["lr"]
    terms = gpt_terms(model, max(LENGTHS), grad_tokens=sum(LENGTHS))  # ~3.7e3
    tol = fp32_tol(terms, 1.0)  # metrics, relative above 1: ~4.4e-4
    # ratio = exp(log-prob - old log-prob), each |log-prob| < 8 from a forward: ~1.7e-3
    ratio_tol = fp32_tol(gpt_terms(model, max(LENGTHS)), 8.0)
    for res in results:
        always, auto = res["always"], res["auto"]
        assert "old_logprobs" in always["fields"] and not always["unchanged"]
        assert "old_logprobs" not in auto["fields"] and auto["unchanged"]
        a, b = always["metrics"], auto["metrics"]
        assert a["skipped_step"] == b["skipped_step"] == 0
        for key in ("loss", "pg_loss", "grad_norm", "entropy", "ratio_mean", "num_tokens"):
            assert b[key] == pytest.approx(a[key], rel=tol, abs=tol), key
        assert b["ratio_min"] == b["ratio_max"] == b["ratio_mean"] == 1.0
        assert a["ratio_max"] == pytest.approx(1.0, abs=ratio_tol)
        assert a["loss"] != 0 and a["grad_norm"] > 0
        ra, rb = always["rollout"], auto["rollout"]
        assert ra["rollout/logprob_mismatch"] > 0.1  # the test compares a real value
        assert rb == pytest.approx(ra, rel=tol, abs=tol)
        for key, value in always["weights"].items():
            w_tol = weight_tol(lr, terms, [always["grad_max"][key[0]]], value)
            torch.testing.assert_close(auto["weights"][key], value, rtol=0, atol=w_tol)
