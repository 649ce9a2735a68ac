"""One optimizer step of a Megatron model: zero grads, forward-backward over micro-batches, step.

Which ranks call: every rank of the world (it runs the pipeline schedule and DP reductions).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_earl.training.schedule import LossFn, MicroBatch, forward_backward, lm_loss


def train_step(
    ddp_chunks: list[nn.Module],
    optimizer,
    micro_batches: list[MicroBatch],
    loss_fn: LossFn = lm_loss,
) -> dict[str, Any]:
    """Returns loss (mean over micro-batches on the last stage, else nan), grad_norm, update_ok."""
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = forward_backward(ddp_chunks, micro_batches, loss_fn)
    update_ok, grad_norm, _ = optimizer.step()
    losses = [float(m["loss"]) for m in metrics]
    return {
        "loss": sum(losses) / len(losses) if losses else float("nan"),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "update_ok": bool(update_ok),
    }


def synthetic_lm_batches(
    vocab_size: int, num_micro_batches: int, micro_batch_size: int, seq_length: int, seed: int
) -> list[MicroBatch]:
    """Fixed random token sequences for smoke runs and tests (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_micro_batches):
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen)
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(micro_batch_size, seq_length),
                "position_ids": torch.arange(seq_length).expand(micro_batch_size, -1).contiguous(),
            }
        )
    return out
