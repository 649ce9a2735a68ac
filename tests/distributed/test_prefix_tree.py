"""Prefix-shared (tree) micro-batches (``training.prefix_tree``) give the unshared packing's
results: the forward-only log-probs of every sample token, and two RL train steps' metrics and
updated parameters (within the fp32 bounds of ``tests/tolerances.py``: the same sums in another
order), on one process with each RoPE kind, and at tp 2 with sequence parallelism (the row padded
for it); the tree row really is shorter."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_old_logprobs import _overrides
from tests.distributed.test_rl_step import LR, MODEL, _config, _setup
from tests.tolerances import fp32_tol, gpt_terms, grad_maxima, weight_tol

PROMPTS = ((5, 9, 2, 17, 33), (7, 1, 60, 4), (8, 8))
"""Groups: 3 samples of prompt 0, 2 of prompt 1, 1 of prompt 2, then one with nothing to train."""
ANSWERS = ((6, 3, 9), (5, 1), (4,))
LENGTHS = [len(p) + n for p, ns in zip(PROMPTS, ANSWERS, strict=True) for n in ns] + [7]
NUM_TERMS = gpt_terms(MODEL, max(LENGTHS), grad_tokens=sum(LENGTHS))
"""A gradient's chain of fp32 sums (forward, backward, the step's tokens)."""
TOL = fp32_tol(NUM_TERMS, 1.0)
"""Metrics, relative to max(1, |value|) (~3.2e-4)."""
FORWARD_TERMS = gpt_terms(MODEL, max(LENGTHS))
"""A log-prob's chain of fp32 sums: its bound is ~1.6e-4 x |log-prob|, while a wrong tree mask or
position moves log-probs by O(1)."""


def _samples(seed: int = 5):
    from megatron_earl.training.microbatch import next_token_sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for prompt, answer_lengths in zip(PROMPTS, ANSWERS, strict=True):
        for n in answer_lengths:
            answer = torch.randint(0, MODEL.vocab_size, (n,), generator=gen)
            tokens = torch.cat([torch.tensor(prompt), answer])
            generated = torch.arange(tokens.numel()) >= len(prompt)
            out.append(_with_fields(next_token_sample(tokens, generated), gen))
    tokens = torch.tensor(PROMPTS[0] + (3, 3))  # same prompt, nothing generated: packed whole
    out.append(_with_fields(next_token_sample(tokens, torch.zeros(7, dtype=torch.bool)), gen))
    return out


def _with_fields(sample, gen):
    n = sample["tokens"].numel()
    for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        sample[name] = -4.6 + 0.3 * torch.randn(n, generator=gen)
    sample["advantages"] = torch.randn(1, generator=gen).expand(n).clone()
    return sample


def _run(
    layout: ParallelLayout,
    weights,
    model,
    tree: bool,
    mask_elements: int | None = None,
    loss: dict | None = None,
):
    from megatron_earl.models import tree_attention
    from megatron_earl.models.gpt import tree_ready
    from megatron_earl.redistribute.geometry import full_state_dict, shard_pieces
    from megatron_earl.training.microbatch import thd_micro_batch
    from megatron_earl.training.prefix_tree import tree_micro_batch
    from megatron_earl.training.rl_step import micro_batch_logprobs, train_micro_batches

    if mask_elements is not None:  # rows over it attend alone, their queries in chunks
        tree_attention.MASK_ELEMENTS = mask_elements
    chunks, ddp, optimizer, weights = _setup(layout, weights, model)
    samples = _samples()
    fields = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    lengths = [s["tokens"].numel() for s in samples]
    sp = layout.tp if model.sequence_parallel else 1
    pack = tree_micro_batch if tree else thd_micro_batch
    whole = [pack(fields, lengths, sp=sp)]
    logprobs = micro_batch_logprobs(chunks, whole)
    config = _config(loss)
    metrics, grads = [], []
    for _ in range(2):
        metrics.append(train_micro_batches(ddp, optimizer, whole, config))
        grads.append(grad_maxima(shard_pieces(chunks)))
    return {
        "weights": weights,
        "ready": tree_ready(chunks),
        "row": whole[0]["tokens"].numel(),
        "logprobs": logprobs,
        "metrics": metrics,
        "grad_max": grads,
        "params": [(p.key, p.region, p.local.detach().clone()) for p in shard_pieces(chunks)],
        "final": full_state_dict(chunks) if layout.world_size == 1 else None,
    }


def _plain_then_tree(layout: ParallelLayout, model, mask_elements=None, loss=None):
    """Both packings in one process (one spawn per case): whole samples from fresh weights,
    then tree rows from the same weights."""
    plain = _run(layout, None, model, False, None, loss)
    return plain, _run(layout, plain["weights"], model, True, mask_elements, loss)


def _assert_same(got, want):
    assert (got["logprobs"] is None) == (want["logprobs"] is None)  # None off the last stage
    for a, b in zip(got["logprobs"] or [], want["logprobs"] or [], strict=True):
        lp_tol = fp32_tol(FORWARD_TERMS, float(b.abs().max()))
        torch.testing.assert_close(a, b, rtol=0, atol=lp_tol)
    for a, b in zip(got["metrics"], want["metrics"], strict=True):
        for key in ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm", "num_tokens"):
            assert a[key] == pytest.approx(b[key], rel=TOL, abs=TOL), key
        assert a["num_samples"] == b["num_samples"]
    for (key, region, a), (_, _, b) in zip(got["params"], want["params"], strict=True):
        tol = weight_tol(LR, NUM_TERMS, [step[key] for step in want["grad_max"]], b)
        torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=f"{key} {region}")


ROPES = {
    "rope": MODEL,
    "linear": dataclasses.replace(MODEL, rope_type="linear", rope_scaling_factor=2.0),
    "llama3": dataclasses.replace(
        MODEL, rope_type="llama3", rope_scaling_factor=8.0, rope_original_max_position_embeddings=64
    ),
    "yarn": dataclasses.replace(
        MODEL, rope_type="yarn", rope_scaling_factor=4.0, rope_original_max_position_embeddings=64
    ),
}


@pytest.mark.parametrize(
    "rope, mask_elements",
    [("rope", None), ("linear", None), ("llama3", None), ("yarn", None), ("rope", 30)],
)
def test_tree_equals_unshared_packing(rope, mask_elements):
    args = (ParallelLayout(), ROPES[rope], mask_elements)
    ((plain, tree),) = run_distributed(_plain_then_tree, 1, args=args, timeout_s=180)
    assert tree["ready"]
    # prompt 0 once for 3 samples (4 shared tokens, twice saved), prompt 1 once for 2 (3 saved)
    assert tree["row"] == plain["row"] - 2 * 4 - 3
    assert [m["num_shared_tokens"] for m in tree["metrics"]] == [11.0, 11.0]
    assert [m["num_shared_tokens"] for m in plain["metrics"]] == [0.0, 0.0]
    _assert_same(tree, plain)


@pytest.mark.parametrize(
    "layout, sequence_parallel, loss",
    [(ParallelLayout(tp=2), True, None), (ParallelLayout(pp=2), False, {"loss_type": "gspo"})],
    ids=["tp2-sp", "pp2-gspo"],
)
def test_tree_in_model_parallel_layouts_equals_unshared_packing(layout, sequence_parallel, loss):
    """tp 2 with sequence parallelism (the row padded to an even length) and pp 2 (every stage
    reads the tree, the last the loss) under GSPO's sequence-level ratios (per-sample sums)."""
    model = dataclasses.replace(MODEL, sequence_parallel=sequence_parallel)
    args = (layout, model, None, loss)
    for want, got in run_distributed(_plain_then_tree, 2, args=args, timeout_s=180):
        assert got["ready"] and (got["row"] % 2 == 0 or not sequence_parallel)
        _assert_same(got, want)


LOOP_OVERRIDES = [
    *_overrides("tp1cp1pp1dp2"),  # the old-log-prob tests' tiny model, every phase in dp2
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=3",
    "batch.max_tokens_per_micro_batch=96",
    "train.lr=1e-3",  # the weights' bound is ~lr/eps x the gradients' (tolerances.adam_weight_tol)
    "train.loss.kl_coef=0.1",
    "train.old_logprobs=always",
]


PROMPT_LENGTHS = (7, 4, 6, 5)


def _loop_batch(rank: int):
    """Four groups of 3 samples (each group's prompt shared), spread over both ranks."""
    from megatron_earl.dispatch import Batch
    from megatron_earl.training.microbatch import next_token_sample

    gen = torch.Generator().manual_seed(9)
    samples, groups = [], []
    for group, prompt_length in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(0, 320, (prompt_length,), generator=gen)
        for answer in (5, 9, 2):
            tokens = torch.cat([prompt, torch.randint(0, 320, (answer,), generator=gen)])
            n = tokens.numel()
            s = next_token_sample(
                tokens,
                torch.arange(n) >= prompt_length,
                rollout_logprobs=-5.8 + 0.3 * torch.randn(n, generator=gen),
            )
            s["advantages"] = torch.randn(1, generator=gen).expand(n) * s["loss_mask"]
            samples.append(s)
            groups.append(group)
    mine = list(range(rank, len(samples), 2))
    names = ("tokens", "labels", "loss_mask", "rollout_logprobs", "advantages")
    return Batch(
        [100 * rank + i for i in mine],
        [samples[i]["tokens"].numel() for i in mine],
        {k: torch.cat([samples[i][k] for i in mine]) for k in names},
        {
            "reward": torch.zeros(len(mine)),
            "policy_version": torch.zeros(len(mine), dtype=torch.int64),
        },
        group_ids=[groups[i] for i in mine],
    )


def _loop_step(share: bool, budget: int):
    """One experience (old and reference log-probs) and train step of the RL loop at dp 2."""
    import torch.distributed as dist

    from megatron_earl.config import load_config
    from megatron_earl.orchestration import samples
    from megatron_earl.orchestration.loop import RLLoop
    from megatron_earl.redistribute.geometry import shard_pieces
    from megatron_earl.tokenizer import build_tokenizer

    flag = str(share).lower()
    overrides = [f"train.prefix_sharing={flag}", f"batch.max_tokens_per_micro_batch={budget}"]
    config = load_config(overrides=[*LOOP_OVERRIDES, *overrides])
    loop = RLLoop(config, build_tokenizer(config.tokenizer))
    rows = []
    pack = samples.tree_micro_batch

    def counted(fields, lengths, *args):
        out = pack(fields, lengths, *args)
        rows.append((sum(lengths), out["tokens"].numel()))
        return out

    samples.tree_micro_batch = counted
    try:
        after = loop.experience(_loop_batch(dist.get_rank()))
        metrics = dict(loop.train(after))
    finally:
        samples.tree_micro_batch = pack
    pieces = shard_pieces(loop.policy.ddp_chunks)
    return {
        "rows": rows,
        "old": after.token_fields["old_logprobs"].clone(),
        "ref": after.token_fields["ref_logprobs"].clone(),
        "metrics": metrics,
        "weights": {(p.key, p.region): p.local.detach().clone() for p in pieces},
        "grad_max": grad_maxima(pieces),
        "model": config.model,
        "lr": config.train.lr,
    }


def _loop_both(budget: int):
    return {share: _loop_step(share, budget) for share in (False, True)}


@pytest.mark.parametrize("budget", [96, 48])
def test_rl_loop_with_prefix_sharing_equals_without(budget):
    """The loop keeps each group on one DP rank (and, with a budget of 48 tokens, each group in
    one of the rank's two micro-batches) and packs it as a tree in the experience and train
    phases; old and reference log-probs, train metrics and weights equal the unshared run's
    (within the fp32 bounds of the same sums in another order)."""
    lengths = [p + a for p in PROMPT_LENGTHS for a in (5, 9, 2)]  # _loop_batch's samples
    for res in run_distributed(_loop_both, 2, args=(budget,), timeout_s=300):
        off, on = res[False], res[True]
        terms = gpt_terms(off["model"], max(lengths), grad_tokens=sum(lengths))
        forward_terms = gpt_terms(off["model"], max(lengths))
        assert off["rows"] == []
        # experience, then train: the same two groups of 3 on each rank, each saving its prompt
        # without the last token (f = prompt length - 1) twice
        num_mb = 1 if budget == 96 else 2
        assert len(on["rows"]) == 2 * num_mb and on["rows"][:num_mb] == on["rows"][num_mb:]
        saved = sum(whole - row for whole, row in on["rows"][:num_mb])
        assert saved in {2 * (a + b - 2) for a, b in itertools.combinations(PROMPT_LENGTHS, 2)}
        if num_mb == 2:  # one whole group per micro-batch
            assert all((whole - row) // 2 + 1 in PROMPT_LENGTHS for whole, row in on["rows"])
        for key in ("old", "ref"):
            lp_tol = fp32_tol(forward_terms, float(off[key].abs().max()))
            torch.testing.assert_close(on[key], off[key], rtol=0, atol=lp_tol)
        metric_tol = fp32_tol(terms, 1.0)  # relative, as TOL
        for key in ("loss", "pg_loss", "kl_loss", "grad_norm", "num_tokens", "logprob_mismatch"):
            got, want = on["metrics"][key], off["metrics"][key]
            assert got == pytest.approx(want, rel=metric_tol, abs=metric_tol), key
        assert off["metrics"]["grad_norm"] > 0
        for key, value in off["weights"].items():
            tol = weight_tol(off["lr"], terms, [off["grad_max"][key[0]]], value)
            torch.testing.assert_close(on["weights"][key], value, rtol=0, atol=tol, msg=str(key))
