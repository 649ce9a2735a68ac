"""Leaving zero-advantage samples out of the train phase (``train.skip_zero_advantage``) gives the
update the whole batch gives, on 2 gloo ranks (the old-log-prob test's tiny run: TIS weights in
the loss), train in dp2 (ppo, token_mean), tp2 (ppo, seq_mean_token_mean: both TP ranks hold
every sample, so the skipped normaliser must not count twice) or cp2 (gspo, seq_mean_token_sum:
each sample split over two ranks).

Two ``RLLoop``s built from the same seed (the same weights), one with the skip off, take the same
two steps the way ``RLLoop.run_step`` does (``skip_zero_advantage`` on the rollout batch, then
``train``):

1. a batch where two of three groups have advantage 0: 4 of 6 samples skipped; loss, pg_loss and the
   grad norm, every parameter's gradient and the updated weights (this rank's shards) agree within
   the fp32 bounds of ``tests/tolerances.py`` (the same sums in another order and packing; Adam
   with its ``ADAM_EPS``, set by the old-log-prob test's overrides): the kept samples' gradients
   are divided by the whole batch's normaliser;
2. a batch where every advantage is 0: the skip keeps one sample per DP rank (the shortest), the
   optimizer still steps (Adam's moments from step 1 move the weights) and the weights agree.

Run: python -m pytest -q tests/distributed/test_zero_advantage.py
"""

from __future__ import annotations

import pytest
import torch

from megatron_earl.testing.distributed import run_distributed
from tests.distributed import test_old_logprobs as old_logprobs_case
from tests.tolerances import adam_weight_tol, fp32_tol, gpt_terms

LENGTHS = [11, 17, 6, 23, 9, 14]


def _overrides(layout: str, aggregation: str, loss: str, skip: bool) -> list[str]:
    """The old-log-prob test's tiny run (TIS on: behaviour weights in the loss) with the loss,
    its aggregation and the skip set."""
    return [
        *old_logprobs_case._overrides(layout),
        f"train.loss.aggregation={aggregation}",
        f"train.loss.loss_type={loss}",
        f"train.skip_zero_advantage={skip}",
    ]


def _batch(rank: int, zero_groups: tuple[int, ...]):
    """Samples 0..5 in groups of 2 (group g: samples 2g, 2g+1), rank r holding samples r, r+2,
    r+4; the groups in ``zero_groups`` have advantage 0 on every token, the others a random
    per-sample advantage on their trainable tokens."""
    from megatron_earl.dispatch import Batch
    from megatron_earl.training.microbatch import next_token_sample

    gen = torch.Generator().manual_seed(5)
    samples = []
    for i, n in enumerate(LENGTHS):
        s = next_token_sample(
            torch.randint(0, 320, (n,), generator=gen),
            torch.arange(n) >= n // 3,
            rollout_logprobs=-5.8 + 0.3 * torch.randn(n, generator=gen),
        )
        adv = 0.0 if i // 2 in zero_groups else float(torch.randn(1, generator=gen))
        s["advantages"] = torch.full((n,), adv) * s["loss_mask"]
        samples.append(s)
    mine = list(range(rank, len(LENGTHS), 2))
    names = ("tokens", "labels", "loss_mask", "rollout_logprobs", "advantages")
    return Batch(
        mine,
        [LENGTHS[i] for i in mine],
        {k: torch.cat([samples[i][k] for i in mine]) for k in names},
        {
            "reward": torch.zeros(len(mine)),
            "policy_version": torch.zeros(len(mine), dtype=torch.int64),
        },
        group_ids=[i // 2 for i in mine],
    )


def _steps(layout: str, aggregation: str, loss: str, skip: bool):
    import torch.distributed as dist

    from megatron_earl import runtime
    from megatron_earl.config import load_config
    from megatron_earl.dispatch import Batch
    from megatron_earl.orchestration.loop import RLLoop
    from megatron_earl.orchestration.zero_advantage import skip_zero_advantage
    from megatron_earl.redistribute.geometry import shard_pieces
    from megatron_earl.tokenizer import build_tokenizer

    config = load_config(overrides=_overrides(layout, aggregation, loss, skip))
    loop = RLLoop(config, build_tokenizer(config.tokenizer))
    out = {"rule": loop.skip_rule is not None, "model": config.model, "lr": config.train.lr}
    for name, zero_groups in (("mixed", (0, 2)), ("all_zero", (0, 1, 2))):
        host = _batch(dist.get_rank(), zero_groups)
        to_device = lambda fields: {k: runtime.to_device(t) for k, t in fields.items()}
        batch = Batch(
            host.sample_ids,
            host.lengths,
            to_device(host.token_fields),
            to_device(host.sample_fields),
            group_ids=host.group_ids,
        )  # on the compute device, as trajectories_to_batch leaves it
        kept, skipped = skip_zero_advantage(batch, loop.skip_rule, loop._skip_floor())
        metrics = dict(loop.train(kept, skipped=skipped))
        pieces = shard_pieces(loop.policy.ddp_chunks)  # keyed by (key, region): every layer
        weights = {(p.key, p.region): p.local.detach().clone() for p in pieces}
        grads = {(p.key, p.region): p.view_of(p.param.main_grad).clone() for p in pieces}  # reduced
        out[name] = {
            "kept": kept.sample_ids,
            "skipped": (skipped.num_samples, skipped.num_tokens),
            "metrics": metrics,
            "weights": weights,
            "grads": grads,
        }
    return out


def _both(layout: str, aggregation: str, loss: str = "ppo"):
    return {skip: _steps(layout, aggregation, loss, skip) for skip in (False, True)}


@pytest.mark.parametrize(
    "layout,aggregation,loss",
    [
        ("tp1cp1pp1dp2", "token_mean", "ppo"),
        ("tp2cp1pp1dp1", "seq_mean_token_mean", "ppo"),
        ("tp1cp2pp1dp1", "seq_mean_token_sum", "gspo"),
    ],
)
def test_skipping_zero_advantage_samples_leaves_the_update_unchanged(layout, aggregation, loss):
    check(run_distributed(_both, 2, args=(layout, aggregation, loss), timeout_s=300), layout)


def check(results: list[dict], layout: str) -> None:
    """The assertions of the test above on every rank's results (host tensors); the emulation
    tier runs the same steps on the emulated device (``tests/emulation``)."""
    dp = 2 if layout.endswith("dp2") else 1
    # The skip drops terms that are exactly 0 and packs the rest into other micro-batches (other
    # GEMM blocking): every compared value is the same chain of fp32 sums in another order, a
    # forward and a backward over the step's tokens (~3.7e3 terms: bound ~4.4e-4 x magnitude).
    model, lr = results[0][False]["model"], results[0][False]["lr"]
    num_terms = gpt_terms(model, max(LENGTHS), grad_tokens=sum(LENGTHS))
    metric_tol = fp32_tol(num_terms, 1.0)  # relative to max(1, |value|)
    for rank, res in enumerate(results):
        full, skip = res[False], res[True]
        assert not full["rule"] and skip["rule"]
        # mixed: groups 0 and 2 (samples 0, 1, 4, 5) are zero; rank 0 holds 0, 2, 4
        mixed_kept = {0: [2], 1: [3]}[rank]
        assert skip["mixed"]["kept"] == mixed_kept
        assert full["mixed"]["kept"] == ([0, 2, 4] if rank == 0 else [1, 3, 5])
        a, b = full["mixed"]["metrics"], skip["mixed"]["metrics"]
        assert full["mixed"]["skipped"] == (0, 0)
        assert skip["mixed"]["skipped"] == (4, 11 + 17 + 9 + 14)
        assert b["num_samples"] == 2 and a["num_samples"] == 6
        assert a["loss"] != 0 and a["grad_norm"] > 0  # the test compares a real update
        for key in ("loss", "pg_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=metric_tol, abs=metric_tol), key
        grad_tols = {}
        for key, g_full in full["mixed"]["grads"].items():
            # fp32 bound of the gradient's sums, relative to the parameter's largest entry (not
            # per entry: an entry summing terms that cancel is small, its rounding is not).
            # Counting the skipped samples twice (seq_mean: 10, not 6) moves the unclipped
            # gradients by 40%: ~900x this; where the clip rescales them, loss and grad_norm
            # above differ by >200x their bound.
            grad_tols[key] = fp32_tol(num_terms, float(g_full.abs().max()))
            g_skip = skip["mixed"]["grads"][key]
            torch.testing.assert_close(g_skip, g_full, rtol=0, atol=grad_tols[key], msg=str(key))
        for key, value in full["mixed"]["weights"].items():
            tol = adam_weight_tol(lr, [grad_tols[key]], float(value.abs().max()))
            torch.testing.assert_close(skip["mixed"]["weights"][key], value, rtol=0, atol=tol)

        # all zero: the shortest samples stay, one per DP rank (6 tokens: sample 2; then 9: 4)
        kept = skip["all_zero"]["kept"]
        assert sum(len(r[True]["all_zero"]["kept"]) for r in results) >= dp
        assert set(kept) <= ({2, 4} if dp == 2 else {2})
        a, b = full["all_zero"]["metrics"], skip["all_zero"]["metrics"]
        assert a["grad_norm"] == b["grad_norm"] == 0.0
        assert all(not g.any() for g in skip["all_zero"]["grads"].values())
        assert a["update_ok"] == b["update_ok"] == 1.0
        moved = False
        for key, value in full["all_zero"]["weights"].items():
            # step 2's gradients are exactly 0 in both runs: step 1's differences carry over
            tol = adam_weight_tol(lr, [grad_tols[key], 0.0], float(value.abs().max()))
            torch.testing.assert_close(skip["all_zero"]["weights"][key], value, rtol=0, atol=tol)
            moved |= not torch.equal(value, full["mixed"]["weights"][key])
        assert moved  # Adam's moments moved the weights with a zero gradient, in both runs
