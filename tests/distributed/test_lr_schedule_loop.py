"""The RL loop applies the learning-rate schedule (``train.lr_decay_style`` & co.) at each
optimizer step: one gloo rank, two mini-batches per step, cosine decay with one warm-up step over
the run's 2 x 2 optimizer steps; the optimizer's rate before each step equals the closed form,
and a zero rate leaves the weights unchanged while a positive one moves them.

Run: python -m pytest -q tests/distributed/test_lr_schedule_loop.py
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_earl.testing.distributed import run_distributed

LENGTHS = [11, 17, 6, 9]
LR, MIN_LR = 1e-2, 0.0


def _batch():
    from megatron_earl.dispatch import Batch
    from megatron_earl.training.microbatch import next_token_sample

    gen = torch.Generator().manual_seed(3)
    samples = []
    for n in LENGTHS:
        s = next_token_sample(
            torch.randint(0, 320, (n,), generator=gen),
            torch.arange(n) >= n // 3,
            rollout_logprobs=-5.8 + 0.3 * torch.randn(n, generator=gen),
        )
        s["advantages"] = torch.randn(1, generator=gen).expand(n) * s["loss_mask"]
        samples.append(s)
    names = ("tokens", "labels", "loss_mask", "rollout_logprobs", "advantages")
    return Batch(
        list(range(len(LENGTHS))),
        LENGTHS,
        {k: torch.cat([s[k] for s in samples]) for k in names},
        {
            "reward": torch.zeros(len(LENGTHS)),
            "policy_version": torch.zeros(len(LENGTHS), dtype=torch.int64),
        },
        group_ids=[i // 2 for i in range(len(LENGTHS))],
    )


def _run():
    from megatron_earl.config import load_config
    from megatron_earl.orchestration.loop import RLLoop
    from megatron_earl.redistribute.geometry import shard_pieces
    from megatron_earl.tokenizer import build_tokenizer

    config = load_config(
        overrides=[
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.ffn_hidden_size=128",
            "model.num_attention_heads=4",
            "model.vocab_size=320",
            "model.make_vocab_size_divisible_by=64",
            "layouts.rollout=tp1cp1pp1dp1",
            "layouts.experience=tp1cp1pp1dp1",
            "layouts.train=tp1cp1pp1dp1",
            "steps=2",
            "batch.prompts_per_step=2",
            "batch.samples_per_prompt=2",
            "batch.num_mini_batches=2",
            "batch.max_tokens_per_micro_batch=48",
            "rollout.max_context=64",
            f"train.lr={LR}",
            f"train.min_lr={MIN_LR}",
            "train.lr_decay_style=cosine",
            "train.lr_warmup_steps=1",
        ]
    )
    loop = RLLoop(config, build_tokenizer(config.tokenizer))
    seen = []
    optimizer = loop.policy.optimizer
    step = optimizer.step

    def recording_step():
        weights = {p.key: p.local.detach().clone() for p in shard_pieces(loop.policy.ddp_chunks)}
        seen.append((optimizer.param_groups[0]["lr"], weights))
        return step()

    optimizer.step = recording_step
    for _ in range(2):
        loop.train(loop.experience(_batch()))
    after = {p.key: p.local.detach().clone() for p in shard_pieces(loop.policy.ddp_chunks)}
    moved = []
    for i, (_, weights) in enumerate(seen):
        nxt = seen[i + 1][1] if i + 1 < len(seen) else after
        moved.append(any(not torch.equal(weights[k], nxt[k]) for k in weights))
    return [lr for lr, _ in seen], moved, loop.policy.version


def test_loop_follows_the_schedule():
    ((rates, moved, version),) = run_distributed(_run, 1, timeout_s=300)
    # warm-up: step 0 at lr_warmup_init (0); then cosine over steps 1..4 (decay length 4)
    want = [0.0] + [
        MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * (s - 1) / 3) + 1) for s in (1, 2, 3)
    ]
    assert version == 4
    # fp64 on both sides: approx's default rel 1e-6 is far above their rounding (~1e-16) and far
    # below a step of the schedule (>1e-2 relative)
    assert rates == pytest.approx(want)
    assert moved == [False, True, True, True]
