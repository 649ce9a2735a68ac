"""The frozen reference policy in the RL loop (``train.loss.kl_coef > 0``), on 2 gloo ranks:
policy master in dp2 (train), reference and experience in tp2, rollout in dp2.

- the experience phase computes ``ref_logprobs`` in the tp2 layout from the reference resharded
  out of the dp2 master, and they equal a single-process forward of the initial weights
  (within the fp32 bound of the forward's sums in another order: ``tests/tolerances.py``);
- the dispatcher carries them to the train layout, where the loss adds the KL term (``kl_ref``
  is emitted, finite; ``kl_loss`` is part of ``loss``);
- a train step changes the policy but not the reference: its parameters are bitwise the same, and
  the next experience phase gives bitwise the same ``ref_logprobs`` while ``old_logprobs`` move.

Run: python -m pytest -q tests/distributed/test_kl_reference.py
"""

from __future__ import annotations

import math

import torch

from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import assert_fp32_close, gpt_terms

OVERRIDES = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.vocab_size=320",
    "model.make_vocab_size_divisible_by=64",
    "layouts.rollout=tp1cp1pp1dp2",
    "layouts.experience=tp2cp1pp1dp1",
    "layouts.train=tp1cp1pp1dp2",
    "batch.prompts_per_step=2",
    "batch.samples_per_prompt=2",
    "batch.max_tokens_per_micro_batch=64",
    "train.lr=1e-2",
    "train.loss.kl_coef=0.1",
    "train.loss.kl_estimator=k3",
    "train.old_logprobs=always",  # the test follows old_logprobs across a train step
]
LENGTHS = [11, 17, 6, 23]


def _batch(rank: int):
    from megatron_earl.dispatch import Batch
    from megatron_earl.orchestration.samples import schema_batch
    from megatron_earl.training.microbatch import next_token_sample

    if rank != 0:
        return schema_batch()
    gen = torch.Generator().manual_seed(3)
    samples = []
    for n in LENGTHS:
        s = next_token_sample(
            torch.randint(0, 320, (n,), generator=gen),
            torch.arange(n) >= n // 3,
            rollout_logprobs=-5.0 + 0.2 * torch.randn(n, generator=gen),
        )
        s["advantages"] = torch.randn(1, generator=gen).expand(n) * s["loss_mask"]
        samples.append(s)
    names = ("tokens", "labels", "loss_mask", "rollout_logprobs", "advantages")
    return Batch(
        range(len(samples)),
        LENGTHS,
        {k: torch.cat([s[k] for s in samples]) for k in names},
        {
            "reward": torch.zeros(len(samples)),
            "policy_version": torch.zeros(len(samples), dtype=torch.int64),
        },
        group_ids=[0, 0, 1, 1],
    )


def _loop_body():
    import torch.distributed as dist

    from megatron_earl.config import load_config
    from megatron_earl.orchestration.loop import RLLoop
    from megatron_earl.redistribute.geometry import full_state_dict
    from megatron_earl.tokenizer import build_tokenizer

    config = load_config(overrides=OVERRIDES)
    loop = RLLoop(config, build_tokenizer(config.tokenizer))
    assert loop.reference is not None and not loop.reference.loaded
    rank = dist.get_rank()
    # dp2 master: rank 0 holds the main replica of every tensor
    initial = full_state_dict(loop.policy.ddp_chunks) if rank == 0 else {}
    batch = _batch(rank)
    first = loop.experience(batch)
    assert loop.reference.loaded  # frozen at the first experience phase
    ref_params = [p.detach().clone() for c in loop.reference.chunks for p in c.parameters()]
    frozen = all(not p.requires_grad for c in loop.reference.chunks for p in c.parameters())
    metrics = loop.train(first)
    after = full_state_dict(loop.policy.ddp_chunks) if rank == 0 else {}
    second = loop.experience(batch)
    same_params = all(
        torch.equal(a, p)
        for a, p in zip(
            ref_params, [p for c in loop.reference.chunks for p in c.parameters()], strict=True
        )
    )
    return {
        "model": config.model,
        "initial": initial,
        "policy_moved": any(not torch.equal(initial[k], after[k]) for k in initial),
        "ref_frozen": frozen,
        "ref_same_params": same_params,
        "first": {k: v for k, v in first.token_fields.items()},
        "second": {k: v for k, v in second.token_fields.items()},
        "metrics": metrics,
    }


def _single_process(weights):
    from megatron_earl import runtime
    from megatron_earl.config import load_config
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import load_full_state_dict
    from megatron_earl.training.rl_step import forward_logprobs

    model = load_config(overrides=OVERRIDES).model
    initialize_layout(ParallelLayout())
    runtime.seed(0)
    chunks = build_model(model)
    load_full_state_dict(chunks, weights)
    for c in chunks:
        c.eval()
    batch = _batch(0)
    samples, start = [], 0
    for n in LENGTHS:
        samples.append({k: v[start : start + n] for k, v in batch.token_fields.items()})
        start += n
    lp, _ = forward_logprobs(chunks, samples, max_tokens=64, vocab_size=model.vocab_size)
    return torch.cat(lp)


def test_reference_logprobs_in_tp2_experience_and_frozen_across_a_train_step():
    results = run_distributed(_loop_body, 2, timeout_s=300)
    owner = results[0]
    assert all(r["ref_frozen"] and r["ref_same_params"] for r in results)
    assert owner["policy_moved"]
    assert results[1]["first"]["ref_logprobs"].numel() == 0  # rank 1 owns no sample
    (single,) = run_distributed(_single_process, 1, args=(owner["initial"],), timeout_s=180)
    mask = owner["first"]["loss_mask"] > 0
    first, second = owner["first"], owner["second"]
    assert first["ref_logprobs"].shape == (sum(LENGTHS),)
    terms = gpt_terms(owner["model"], max(LENGTHS))  # a log-prob's sums: ~2e-4 x |log-prob|
    assert_fp32_close(first["ref_logprobs"][mask], single[mask], terms)
    # before any update the reference is the policy: ref == old log-probs
    assert_fp32_close(first["ref_logprobs"], first["old_logprobs"], terms)
    # after the update: the reference did not move, the policy did (the same forward of the
    # same weights is bitwise: any change is the update's, O(0.1) after a step at lr 1e-2)
    assert torch.equal(second["ref_logprobs"], first["ref_logprobs"])
    assert (second["old_logprobs"][mask] - first["old_logprobs"][mask]).abs().max() > 1e-4
    for r in results:  # the same metrics on every rank
        m = r["metrics"]
        assert math.isfinite(m["kl_ref"]) and m["kl_ref"] >= 0
        assert math.isfinite(m["kl_loss"]) and m["skipped_step"] == 0
