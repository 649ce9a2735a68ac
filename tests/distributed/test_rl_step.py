"""The RL train step (``training.rl_step``): two steps in TP2, DP2, PP2 and CP2 give the same
updated parameters and metrics as one process on the same data (within the fp32 bounds of
``tests/tolerances.py``: Adam with ``ADAM_EPS``, ``weight_tol``; metrics ``TOL``); GRPO on a
toy bandit raises the probability of the rewarded token; bad input is handled the documented way
on every rank (dropped and counted, or one clear error everywhere; a non-finite update is
skipped; a non-finite gradient on one rank is seen on every rank)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import ADAM_EPS, fp32_tol, gpt_terms, grad_maxima, weight_tol

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=96,
    make_vocab_size_divisible_by=32,
)
LENGTHS = [9, 17, 4, 12, 6, 20, 11, 7]
NUM_TERMS = gpt_terms(MODEL, max(LENGTHS), grad_tokens=sum(LENGTHS))
"""A gradient's chain of fp32 sums: forward and backward per token, then the sum over the step's
tokens (~2.7e3 terms)."""
TOL = fp32_tol(NUM_TERMS, 1.0)
"""Metrics, relative to max(1, |value|) (~3.3e-4): each is a mean or a norm over the step's tokens
of values from that chain. The fractions (clip, TIS, masks) are counts of tokens past a bound:
equal unless a ratio lies within this of a bound, and one token off moves them by >1e-2."""
LR = 1e-3


def _samples(seed: int = 3):
    from megatron_earl.training.microbatch import next_token_sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        tokens = torch.randint(0, MODEL.vocab_size, (n,), generator=gen)
        generated = torch.arange(n) >= n // 3  # prompt, then the response
        s = next_token_sample(
            tokens,
            generated,
            old_logprobs=-4.6 + 0.3 * torch.randn(n, generator=gen),
            ref_logprobs=-4.6 + 0.3 * torch.randn(n, generator=gen),
            rollout_logprobs=-4.6 + 0.3 * torch.randn(n, generator=gen),
        )
        s["advantages"] = torch.randn(1, generator=gen).expand(n).clone()
        out.append(s)
    return out


def _config(loss_kw: dict | None = None, **kw):
    from megatron_earl.config.loss import PolicyLossConfig
    from megatron_earl.training.rl_step import RLStepConfig

    loss = dict(
        aggregation="seq_mean_token_mean",
        kl_coef=0.1,
        entropy_coef=0.01,
        dual_clip_c=3.0,
        tis_cap=2.0,
        clip_eps_high=0.28,
    )
    loss = PolicyLossConfig(**{**loss, **(loss_kw or {})})
    return RLStepConfig(loss=loss, max_tokens_per_micro_batch=24, logprob_chunk_size=16, **kw)


def _setup(layout: ParallelLayout, weights, model: ModelConfig = MODEL, lr: float = LR):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import full_state_dict, load_full_state_dict
    from megatron_earl.training.setup import (
        OptimConfig,
        build_optimizer,
        wire_schedule_hooks,
        wrap_ddp,
    )

    initialize_layout(layout)
    runtime.seed(11)
    chunks = build_model(model, vpp=layout.vpp)
    if weights is None and layout.world_size == 1:
        weights = full_state_dict(chunks)
    if weights is not None:
        load_full_state_dict(chunks, weights)
    optim = OptimConfig(lr=lr, clip_grad=1.0, adam_eps=ADAM_EPS)
    ddp = wrap_ddp(chunks, optim)
    optimizer = build_optimizer(ddp, optim)
    wire_schedule_hooks(ddp, optimizer)
    return chunks, ddp, optimizer, weights


def _train(
    layout: ParallelLayout,
    weights,
    steps: int,
    model: ModelConfig = MODEL,
    loss_kw: dict | None = None,
):
    from megatron.core import parallel_state

    from megatron_earl.redistribute.geometry import full_state_dict, shard_pieces
    from megatron_earl.training.rl_step import rl_train_step

    chunks, ddp, optimizer, weights = _setup(layout, weights, model)
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = _samples()[dp_rank :: layout.dp]
    metrics, grads = [], []
    for _ in range(steps):
        metrics.append(rl_train_step(ddp, optimizer, mine, _config(loss_kw)))
        grads.append(grad_maxima(shard_pieces(chunks)))
    params = [(p.key, p.region, p.local.detach().clone()) for p in shard_pieces(chunks)]
    final = full_state_dict(chunks) if layout.world_size == 1 else None
    return {
        "weights": weights,
        "metrics": metrics,
        "grad_max": grads,  # per step: the largest |gradient entry| of each parameter
        "params": params,
        "final": final,
    }


@pytest.fixture(scope="module")
def reference():
    (res,) = run_distributed(_train, 1, args=(ParallelLayout(), None, 2), timeout_s=180)
    return res


COMPARED = ("loss", "pg_loss", "kl_loss", "entropy", "clip_frac_high", "clip_frac_low",
            "approx_kl", "kl_ref", "ratio_mean", "ratio_max", "ratio_min", "num_tokens",
            "num_samples", "grad_norm", "tis_weight_mean", "tis_clip_frac", "is_mask_frac",
            "is_weight_mean", "is_weight_max", "is_weight_min", "is_seq_clip_frac",
            "is_seq_mask_frac")  # fmt: skip


def assert_matches_reference(res: dict, reference: dict, num_terms: int = NUM_TERMS) -> None:
    """One rank's shards equal the single-process run's final weights (``weight_tol``: Adam's
    steps on gradients within their fp32 bound) and its step metrics equal the reference's (TOL,
    relative above 1), every step applied."""
    from megatron_earl.redistribute.geometry import region_slices

    for key, region, local in res["params"]:
        expected = reference["final"][key][region_slices(region)].reshape(local.shape)
        # 3e-7 (norms) to 1.5e-5 (embeddings): each parameter's two steps move it by >100x
        # that, so a step lost, repeated or applied to another shard shows
        grad_max = [step[key] for step in reference["grad_max"]]
        tol = weight_tol(LR, num_terms, grad_max, expected)
        torch.testing.assert_close(local, expected, rtol=0, atol=tol, msg=key)
    for got, want in zip(res["metrics"], reference["metrics"], strict=True):
        for k in COMPARED:
            assert abs(got[k] - want[k]) <= TOL * max(1.0, abs(want[k])), (k, got[k], want[k])
        assert got["skipped_step"] == 0 and got["update_ok"] == 1


@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(tp=2), ParallelLayout(dp=2), ParallelLayout(pp=2), ParallelLayout(cp=2)],
    ids=str,
)
def test_train_step_equals_single_process(reference, layout):
    results = run_distributed(_train, 2, args=(layout, reference["weights"], 2), timeout_s=240)
    for res in results:
        assert_matches_reference(res, reference)
    m = reference["metrics"][0]
    assert m["num_samples"] == len(LENGTHS) and m["num_micro_batches"] >= 3
    assert 0 < m["clip_frac_high"] + m["clip_frac_low"] < 1  # the clipped branch is exercised
    assert m["kl_loss"] > 0 and m["entropy"] > 0 and m["tokens_per_s"] > 0
    assert 0 < m["tis_clip_frac"] < 1 and m["is_weight_max"] > 2.0 > m["tis_weight_mean"]


SEQ_MIS = {"tis_cap": None, "off_policy_correction": "mis", "off_policy_level": "sequence",
           "is_weight_low": 0.5, "is_weight_high": 2.0}  # fmt: skip
"""Sequence-level masked IS: each sample's weight is a product over its tokens, split over CP."""


@pytest.fixture(scope="module")
def seq_mis_reference():
    args = (ParallelLayout(), None, 2, MODEL, SEQ_MIS)
    (res,) = run_distributed(_train, 1, args=args, timeout_s=180)
    return res


@pytest.mark.parametrize("layout", [ParallelLayout(dp=2), ParallelLayout(cp=2)], ids=str)
def test_sequence_level_mis_equals_single_process(seq_mis_reference, layout):
    """Whole-sample log-weight sums over CP and the sample-share counts over DP/CP: the same
    masked samples, update and metrics as one process."""
    from megatron_earl.redistribute.geometry import region_slices

    reference = seq_mis_reference
    args = (layout, reference["weights"], 2, MODEL, SEQ_MIS)
    results = run_distributed(_train, 2, args=args, timeout_s=240)
    final = reference["final"]
    for res in results:
        for key, region, local in res["params"]:
            expected = final[key][region_slices(region)].reshape(local.shape)
            grad_max = [step[key] for step in reference["grad_max"]]
            tol = weight_tol(LR, NUM_TERMS, grad_max, expected)
            torch.testing.assert_close(local, expected, rtol=0, atol=tol, msg=key)
        for got, want in zip(res["metrics"], reference["metrics"], strict=True):
            for k in COMPARED:
                assert abs(got[k] - want[k]) <= TOL * max(1.0, abs(want[k])), (k, got[k], want[k])
    m = reference["metrics"][0]
    # some samples masked, some kept: the mask decides per sample, on every token of it
    assert 0 < m["is_seq_mask_frac"] < 1 and 0 < m["is_mask_frac"] < 1, m
    assert m["is_seq_clip_frac"] == 0 and m["tis_clip_frac"] == 0


BANDIT = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=8,
    make_vocab_size_divisible_by=16,  # 8 padded rows, excluded from the softmax (vocab_size=8)
)
TARGET = 3
PROMPTS, GROUP, STEPS = 4, 8, 4


def _bandit():
    """GRPO on one-token responses: reward 1 for emitting TARGET. Returns p(TARGET) per step."""
    from megatron_earl.training.advantages import AdvantageInputs, build_estimator
    from megatron_earl.training.microbatch import next_token_sample
    from megatron_earl.training.rl_step import RLStepConfig, forward_logprobs, rl_train_step

    chunks, ddp, optimizer, _ = _setup(ParallelLayout(), None, BANDIT, lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, BANDIT.vocab_size, (PROMPTS, 4), generator=gen)
    estimator = build_estimator("grpo")
    config = RLStepConfig(max_tokens_per_micro_batch=64, vocab_size=BANDIT.vocab_size)
    probs = []
    for _ in range(STEPS + 1):
        with torch.no_grad():
            logits = chunks[0](prompts, torch.arange(4).expand(PROMPTS, 4), None)[:, -1]
        p = torch.softmax(logits[:, : BANDIT.vocab_size].float(), -1)
        probs.append(float(p[:, TARGET].mean()))
        if len(probs) > STEPS:
            break
        actions = torch.multinomial(p, GROUP, replacement=True, generator=gen)  # [P, G]
        samples = [
            next_token_sample(torch.cat([prompts[i], actions[i, g : g + 1]]), torch.arange(5) == 4)
            for i in range(PROMPTS)
            for g in range(GROUP)
        ]
        rewards = (actions.reshape(-1) == TARGET).float()
        mask = torch.stack([s["loss_mask"] for s in samples])
        groups = torch.arange(PROMPTS).repeat_interleave(GROUP)
        adv = estimator.compute(AdvantageInputs(rewards, groups, mask)).advantages
        old, _ = forward_logprobs(chunks, samples, max_tokens=64, vocab_size=BANDIT.vocab_size)
        for s, a, lp in zip(samples, adv, old, strict=True):
            s["advantages"], s["old_logprobs"] = a, lp
        rl_train_step(ddp, optimizer, samples, config)
    return probs


def test_grpo_bandit_raises_target_probability():
    (probs,) = run_distributed(_bandit, 1, timeout_s=180)
    assert probs[-1] > probs[0] + 0.3, probs  # from ~1/8 (0.12) to ~0.58 in 4 steps
    assert probs[-1] > 3 * probs[0], probs


def _bad_inputs():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_earl.redistribute.geometry import shard_pieces
    from megatron_earl.training.logprobs import output_weight
    from megatron_earl.training.rl_step import _grads_finite, rl_train_step

    chunks, ddp, optimizer, _ = _setup(ParallelLayout(dp=2), None)
    rank = parallel_state.get_data_parallel_rank()
    out = {}

    def attempt(name, samples, config):
        try:
            out[name] = rl_train_step(ddp, optimizer, samples, config)
        except ValueError as err:
            out[name] = str(err)

    base = _samples()[rank::2]
    # 1. NaN advantage on one trainable token of one sample of rank 1: dropped and counted
    nan = [dict(s) for s in base]
    if rank == 1:
        nan[0]["advantages"] = nan[0]["advantages"].clone()
        nan[0]["advantages"][-2] = float("nan")
        nan[1]["old_logprobs"] = nan[1]["old_logprobs"].clone()
        nan[1]["old_logprobs"][0] = float("inf")  # masked position (prompt): ignored
    attempt("drop", nan, _config())
    attempt("raise", nan, _config(on_nonfinite="raise"))
    # 2. all-masked sample (empty response) on rank 0: counted, finite
    empty = [dict(s) for s in base]
    if rank == 0:
        empty[0]["loss_mask"] = torch.zeros_like(empty[0]["loss_mask"])
    attempt("empty", empty, _config())
    # 3. a sample above the token budget on rank 0 only: the same error on both ranks
    long = [dict(s) for s in base]
    if rank == 0:
        long = [{k: v.repeat(4) for k, v in s.items()} for s in long]
    attempt("budget", long, _config())
    # 4. a rank without samples
    attempt("no_samples", base if rank == 0 else [], _config())
    # 5. an off-policy correction, and rank 1's samples lack the behaviour log-probs
    no_rollout = base if rank == 0 else [{k: v for k, v in s.items() if k != "rollout_logprobs"}
                                         for s in base]  # fmt: skip
    attempt("no_rollout", no_rollout, _config(SEQ_MIS))
    # the gradient check: an inf in one parameter's gradient on rank 1 only is seen everywhere
    params = [p for p in ddp[0].parameters() if p.requires_grad]
    grad = params[len(params) // 2].main_grad.view(-1)
    out["grads_finite"] = [_grads_finite(ddp)]
    with torch.no_grad():
        if rank == 1:
            grad[grad.numel() // 2] = float("inf")
        out["grads_finite"].append(_grads_finite(ddp))
        grad.zero_()
    # 6. a NaN weight: non-finite loss and grads, the update is skipped
    with torch.no_grad():
        output_weight(chunks[0])[5, 0] = float("nan")
    before = [p.local.detach().clone() for p in shard_pieces(chunks)]
    attempt("nan_weight", base, _config())
    after = [p.local.detach() for p in shard_pieces(chunks)]
    out["unchanged"] = all(torch.equal(a, b) or a.isnan().any() for a, b in zip(before, after))
    dist.barrier()
    return out


def test_bad_input_is_reported_or_rejected_on_every_rank():
    results = run_distributed(_bad_inputs, 2, timeout_s=240)
    for out in results:
        drop = out["drop"]
        assert isinstance(drop, dict) and drop["num_nonfinite_samples"] == 1
        assert drop["skipped_step"] == 0 and math.isfinite(drop["loss"])
        assert "rank 1: ValueError: samples [0]" in out["raise"]
        assert "NaN/inf at trainable positions" in out["raise"]
        assert out["empty"]["num_empty_samples"] == 1 and math.isfinite(out["empty"]["loss"])
        assert "rank 0: " in out["budget"] and "above the micro-batch budget" in out["budget"]
        assert "rank 1: ValueError: this rank has 0 samples" in out["no_samples"]
        missing = "rank 1: ValueError: off_policy_correction='mis' needs a rollout_logprobs"
        assert missing in out["no_rollout"]
        nan_weight = out["nan_weight"]
        assert nan_weight["skipped_step"] == 1 and nan_weight["update_ok"] == 0
        assert math.isnan(nan_weight["grad_norm"])
        assert out["unchanged"]
        assert out["grads_finite"] == [True, False]
