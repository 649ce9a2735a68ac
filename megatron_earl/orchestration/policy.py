"""The policy in every phase layout of a run: one trainable copy, resharded copies for the others.

The train layout's model chunks are the master copy (Megatron DDP + optimizer). Each other distinct
phase layout (rollout, experience) gets its own model chunks built in that layout, without
gradients; ``sync(layout)`` reshards the master weights into them point to point
(``redistribute.weight_exec``), so no rank ever gathers the whole model. A phase whose layout
equals the train layout uses the master chunks directly. A layout first needed mid-run (the
selector's choice) gets its copy lazily (``ensure``), built the same way on every rank.

Which ranks call: every method is called by every rank of the world (SPMD).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_earl import runtime
from megatron_earl.config.model import ModelConfig
from megatron_earl.models.gpt import build_model
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.parallel.state import use_layout
from megatron_earl.redistribute.geometry import ShardPiece, shard_pieces
from megatron_earl.redistribute.weight_exec import reshard_weights
from megatron_earl.training.setup import OptimConfig, build_optimizer, wire_schedule_hooks, wrap_ddp


@dataclass
class PhaseCopy:
    """The policy's chunks in one non-train layout and their shard geometry."""

    layout: ParallelLayout
    chunks: list[nn.Module]
    pieces: list[ShardPiece]
    version: int = -1
    """Weight version last synced into these chunks (-1: never)."""


@dataclass
class Policy:
    """Master (train-layout) chunks with DDP and optimizer, plus the other layouts' copies."""

    model: ModelConfig
    train_layout: ParallelLayout
    ddp_chunks: list[nn.Module]
    optimizer: object
    master_pieces: list[ShardPiece]
    copies: dict[ParallelLayout, PhaseCopy] = field(default_factory=dict)
    version: int = 0
    """Weight version of the master copy: the number of optimizer steps taken."""
    bucket_bytes: int = 64 << 20
    seed: int = 0
    """Seed of the copies' initialisation (their weights are overwritten by ``sync``)."""

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        layouts: dict[str, ParallelLayout],
        optim: OptimConfig,
        seed: int,
    ) -> Policy:
        """Build the master copy in ``layouts["train"]`` and a copy per other distinct layout.
        Ends with the train layout active."""
        train = layouts["train"]
        copies = {}
        for layout in dict.fromkeys(layouts.values()):
            if layout == train:
                continue
            use_layout(layout)
            runtime.seed(seed)
            copies[layout] = _build_copy(model, layout)
        use_layout(train)
        runtime.seed(seed)
        ddp = wrap_ddp(build_model(model, vpp=train.vpp), optim)
        optimizer = build_optimizer(ddp, optim)
        wire_schedule_hooks(ddp, optimizer)
        # Pieces after DDP wrapping: DDP moves parameters into its contiguous buffers.
        return cls(model, train, ddp, optimizer, shard_pieces(ddp), copies, seed=seed)

    def ensure(self, layout: ParallelLayout) -> bool:
        """Build ``layout``'s copy if it has none yet (``layout`` must be active; the global RNG
        streams are left as they were). Returns True when it built one. Every rank calls, with
        the same layout (building may create process groups: a collective over the world)."""
        if layout == self.train_layout or layout in self.copies:
            return False
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            runtime.seed(self.seed)
            self.copies[layout] = _build_copy(self.model, layout)
        return True

    def chunks(self, layout: ParallelLayout) -> list[nn.Module]:
        """The policy's chunks in ``layout`` (the master chunks for the train layout)."""
        return self.ddp_chunks if layout == self.train_layout else self.copies[layout].chunks

    def sync(self, layout: ParallelLayout) -> dict[str, float]:
        """Reshard the master weights into ``layout``'s copy if it is stale. Collective (world)."""
        if layout == self.train_layout or self.copies[layout].version == self.version:
            return {}
        copy = self.copies[layout]
        start = time.perf_counter()
        stats = reshard_weights(self.master_pieces, copy.pieces, bucket_bytes=self.bucket_bytes)
        copy.version = self.version
        return {
            "reshard_s": time.perf_counter() - start,
            "reshard_bytes_sent": float(stats.bytes_sent),
        }


def _build_copy(model: ModelConfig, layout: ParallelLayout) -> PhaseCopy:
    """Chunks of ``model`` in the active ``layout``, without gradients, in eval mode."""
    chunks = build_model(model, vpp=layout.vpp)
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return PhaseCopy(layout, chunks, shard_pieces(chunks))
