"""Supervised warm start on an environment's demonstrations, in the train layout.

Demonstrations are the environment's ideal multi-turn conversations rendered exactly as the agent
loop would produce them (``rollout.agent.sft``), trained only on the assistant tokens. A fraction
of them can come from a *weak teacher* that answers without using the tool (a guessed number):
the warm-started policy then imitates both behaviours, which is the realistic starting point RL
improves on (it learns from reward which behaviour works).

The update is the RL train step with advantage 1 on every trainable token and no old log-probs:
the clipped policy loss is then exactly on-policy (ratio 1, nothing clipped) and its gradient is
the gradient of the token-mean negative log-likelihood. One code path, one set of metrics.

Which ranks call: every rank of the world, with the train layout active.
"""

from __future__ import annotations

import random

import torch
from megatron.core import parallel_state

from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.config.run import SFTConfig
from megatron_earl.envs.base import ENVS
from megatron_earl.rollout.agent.sft import demonstration_tokens
from megatron_earl.tokenizer.base import ChatTokenizer
from megatron_earl.training.microbatch import next_token_sample
from megatron_earl.training.rl_step import RLStepConfig, rl_train_step


def demonstration(env, seed: int, weak: bool, rng: random.Random) -> list[dict]:
    """The ideal conversation of ``seed``, or the weak teacher's (answers at once, guessing)."""
    messages = env.demonstration(seed)
    if not weak:
        return messages
    guess = str(rng.randint(-20, 90))
    return [messages[0], {"role": "assistant", "content": guess}]


def sft_samples(
    env_spec: dict, seeds: list[int], tokenizer: ChatTokenizer, weak_fraction: float, seed: int
) -> list[dict[str, torch.Tensor]]:
    """Train-step samples (tokens, labels, loss_mask, advantages=1) of the demonstrations."""
    env = ENVS.build(env_spec)
    rng = random.Random(seed)
    out = []
    for s in seeds:
        weak = rng.random() < weak_fraction
        prompt, response, mask = demonstration_tokens(demonstration(env, s, weak, rng), tokenizer)
        tokens = torch.tensor(prompt + response)
        generated = torch.tensor([0] * len(prompt) + mask, dtype=torch.bool)
        sample = next_token_sample(tokens, generated)
        sample["advantages"] = sample["loss_mask"].float()
        out.append(sample)
    return out


def warm_start(
    ddp_chunks: list,
    optimizer,
    config: SFTConfig,
    env_spec: dict,
    tokenizer: ChatTokenizer,
    *,
    max_tokens_per_micro_batch: int,
    vocab_size: int,
    log=None,
) -> list[dict[str, float]]:
    """Run ``config.steps`` supervised steps; returns their metrics."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    if config.examples_per_step < dp:
        raise ValueError(f"sft.examples_per_step ({config.examples_per_step}) must be >= dp ({dp})")
    step_config = RLStepConfig(
        loss=PolicyLossConfig(),
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        vocab_size=vocab_size,
    )
    history = []
    lrs = [group["lr"] for group in optimizer.param_groups]
    if config.lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = config.lr
    for step in range(config.steps):
        first = config.seed_offset + step * config.examples_per_step
        seeds = list(range(first, first + config.examples_per_step))[dp_rank::dp]
        samples = sft_samples(
            env_spec, seeds, tokenizer, config.weak_teacher_fraction, seed=first + dp_rank
        )
        metrics = rl_train_step(ddp_chunks, optimizer, samples, step_config)
        history.append(metrics)
        if log is not None:
            log(step, metrics)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    return history
