"""The policy in every phase layout of a run: one trainable copy, resharded copies for the others.

The train layout's model chunks are the master copy (Megatron DDP + optimizer). Each other distinct
phase layout (rollout, experience) gets its own model chunks built in that layout, without
gradients; ``sync(layout)`` reshards the master weights into them point to point
(``redistribute.weight_exec``), so no rank ever gathers the whole model. A phase whose layout
equals the train layout uses the master chunks directly (no reshard at all), and a copy already at
the master's weight version is not resharded again; the reshard plan of a copy is made at its
first sync and reused until the master moves. A layout first needed mid-run (the selector's
choice) gets its copy lazily (``ensure``), built the same way on every rank.

The master itself can move: ``move_master(layout)`` builds the chunks, DDP and optimizer in
``layout`` and reshards the weights *and* Adam's state into them
(``redistribute.optimizer_state``), losslessly, so the next step computes what it would have
computed in the old layout (up to the new layout's floating-point reduction order). The old
master is dropped (``ensure`` rebuilds a copy of the old layout when a phase needs it again);
a copy that existed in ``layout`` is dropped too (the master serves that layout now); copies in
other layouts stay valid. The distributed optimizer's state cannot move (``ValueError``).
While moving, a rank holds both masters (the old one is freed afterwards).

Which ranks call: every method is called by every rank of the world (SPMD).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from megatron_earl import runtime
from megatron_earl.config.model import ModelConfig
from megatron_earl.config.optim import OptimConfig
from megatron_earl.config.vocab import Phase
from megatron_earl.models.gpt import build_model
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.parallel.state import use_layout
from megatron_earl.redistribute.geometry import ShardPiece, shard_pieces
from megatron_earl.redistribute.optimizer_state import (
    check_supported,
    reshard_model_and_optimizer,
)
from megatron_earl.redistribute.weight_exec import execute_plan, gather_plan
from megatron_earl.redistribute.weight_plan import WeightPlan
from megatron_earl.training.setup import build_optimizer, wire_schedule_hooks, wrap_ddp


@dataclass
class PhaseCopy:
    """The policy's chunks in one non-train layout and their shard geometry."""

    layout: ParallelLayout
    chunks: list[nn.Module]
    pieces: list[ShardPiece]
    version: int = -1
    """Weight version last synced into these chunks (-1: never)."""
    plan: WeightPlan | None = None
    """The reshard plan master -> these chunks, made at the first sync (None: not yet, or the
    master moved since): the pieces on both sides stay the same until the master moves."""


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
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer settings of the master (a moved master gets a new optimizer with them)."""

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        layouts: dict[str, ParallelLayout],
        optim: OptimConfig,
        seed: int,
    ) -> Policy:
        """Build the master copy in ``layouts[Phase.TRAIN]`` and a copy per other distinct layout.
        Ends with the train layout active."""
        train = layouts[Phase.TRAIN]
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
        return cls(model, train, ddp, optimizer, shard_pieces(ddp), copies, seed=seed, optim=optim)

    def ensure(self, layout: ParallelLayout) -> bool:
        """Build ``layout``'s copy if it has none yet (``layout`` must be active; the global RNG
        streams are left as they were). Returns True when it built one. Every rank calls, with
        the same layout (building may create process groups: a collective over the world)."""
        if layout == self.train_layout or layout in self.copies:
            return False
        with _isolated_rng(self.seed):
            self.copies[layout] = _build_copy(self.model, layout)
        return True

    def move_master(self, layout: ParallelLayout) -> dict[str, float]:
        """Move the master copy (weights and Adam state) to ``layout`` (module docstring);
        ``train_layout``, ``ddp_chunks``, ``optimizer`` and ``master_pieces`` then describe the
        new master. Returns ``move_s`` and ``move_bytes_sent`` (this rank), or {} when
        ``layout`` is already the train layout. Ends with ``layout`` active; the global RNG
        streams are left as they were. Every rank calls, with the same layout (a collective
        over the world: process groups, metadata all-gather, point-to-point rounds)."""
        if layout == self.train_layout:
            use_layout(layout)
            return {}
        check_supported(self.optimizer)  # before anything changes
        start = time.perf_counter()
        self.copies.pop(layout, None)  # the master serves ``layout`` now: free it first
        use_layout(layout)
        with _isolated_rng(self.seed):
            ddp = wrap_ddp(build_model(self.model, vpp=layout.vpp), self.optim)
        optimizer = build_optimizer(ddp, self.optim)
        wire_schedule_hooks(ddp, optimizer)
        pieces = shard_pieces(ddp)  # after DDP wrapping (it moves parameters into its buffers)
        stats = reshard_model_and_optimizer(
            self.master_pieces, self.optimizer, pieces, optimizer, bucket_bytes=self.bucket_bytes
        )
        self.train_layout, self.ddp_chunks, self.optimizer = layout, ddp, optimizer
        self.master_pieces = pieces
        for copy in self.copies.values():  # planned from the old master's pieces
            copy.plan = None
        return {"move_s": time.perf_counter() - start, "move_bytes_sent": float(stats.bytes_sent)}

    def retain(self, layouts) -> list[ParallelLayout]:
        """Drop the copies of layouts not in ``layouts`` (a selector's past choices and the
        start-up profiling's candidates; ``ensure`` rebuilds one if it is chosen again) and
        return the dropped layouts. Local: no communication (every rank drops the same ones)."""
        keep = set(layouts)
        dropped = [layout for layout in self.copies if layout not in keep]
        for layout in dropped:
            del self.copies[layout]
        return dropped

    def chunks(self, layout: ParallelLayout) -> list[nn.Module]:
        """The policy's chunks in ``layout`` (the master chunks for the train layout)."""
        return self.ddp_chunks if layout == self.train_layout else self.copies[layout].chunks

    def sync(self, layout: ParallelLayout) -> dict[str, float]:
        """Reshard the master weights into ``layout``'s copy if it is stale: nothing when
        ``layout`` is the train layout (the master serves it) or the copy holds the current
        version. The plan is made once per (master, copy) pair and reused (``PhaseCopy.plan``:
        the metadata all-gather and the planning run at the first sync only). Collective
        (world): every rank calls with the same layout, and every rank holds the same plans."""
        if layout == self.train_layout or self.copies[layout].version == self.version:
            return {}
        copy = self.copies[layout]
        start = time.perf_counter()
        if copy.plan is None:
            copy.plan = gather_plan(self.master_pieces, copy.pieces, self.bucket_bytes)
        stats = execute_plan(copy.plan, self.master_pieces, copy.pieces)
        copy.version = self.version
        return {
            "reshard_s": time.perf_counter() - start,
            "reshard_bytes_sent": float(stats.bytes_sent),
        }


@contextlib.contextmanager
def _isolated_rng(seed: int) -> Iterator[None]:
    """Seed the default generators and Megatron's tracker with ``seed`` for the body, then
    restore both (``runtime.preserved_rng``). Local."""
    with runtime.preserved_rng():
        runtime.seed(seed)
        yield


def _build_copy(model: ModelConfig, layout: ParallelLayout) -> PhaseCopy:
    """Chunks of ``model`` in the active ``layout``, without gradients, in eval mode."""
    chunks = build_model(model, vpp=layout.vpp)
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return PhaseCopy(layout, chunks, shard_pieces(chunks))
