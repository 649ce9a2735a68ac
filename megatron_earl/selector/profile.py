"""Run the real phases of a model in any layout on the live processes, measured: the selector's
profiling runs, its CPU calibration, and the benchmark all go through ``PhaseRunner``.

    runner = PhaseRunner(model, budget=MemoryBudget(256 << 20))
    runner.switch(ParallelLayout(dp=2))              # builds the model (first time) or reshards
    result = runner.run(Phase.TRAIN, samples)            # rl_train_step on this DP rank's share
    result.tokens_per_s, result.peak_bytes           # peak: max over ranks, static + dynamic
    result = profile_layout(runner, table, Phase.TRAIN, layout, lengths, steps=2)   # fills table

``switch`` keeps one layout's model and optimizer at a time: entering another layout builds its
chunks, DDP and optimizer, copies the weights *and* Adam's moments from the previous layout
(``redistribute.optimizer_state.reshard_model_and_optimizer``), and
drops the previous layout's objects. A ``run`` times the phase (wall time, and wall time without
CPU contention: the machine is shared, see ``runqueue_wait_s``) and measures its peak with
``MemoryBudget.track``
(static = this layout's parameters, grad buffers and optimizer state) and enforces the budget:
the train phase checks it before ``optimizer.step()``, the experience phase at its end, so an
over-budget phase raises ``BudgetExceeded`` on every rank with no update applied.

Which ranks call: every rank of the world, with the same samples and layouts.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.optim import OptimConfig
from megatron_earl.config.vocab import Phase
from megatron_earl.parallel.cp import cp_padded_length
from megatron_earl.parallel.groups import host_group
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.budget import MemoryBudget, state_bytes
from megatron_earl.selector.throughput import ThroughputTable


def runqueue_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux schedstat; 0 where
    unavailable). On a shared machine, subtracting it from wall time removes the time other
    processes held the cores, while time blocked on communication or pipeline bubbles stays."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class BusyClock:
    """Wall and busy time of named blocks on this rank; busy = wall minus run-queue wait
    (``runqueue_wait_s``), the figure a shared machine does not inflate.

        clock = BusyClock()
        with clock(Phase.TRAIN):
            ...
        clock.wall[Phase.TRAIN], clock.min_busy()[Phase.TRAIN]      # min_busy: collective (world)
    """

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.busy: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start, waited = time.perf_counter(), runqueue_wait_s()
        try:
            yield
        finally:
            self.wall[name] = time.perf_counter() - start
            self.busy[name] = self.wall[name] - (runqueue_wait_s() - waited)

    def min_busy(self) -> dict[str, float]:
        """Busy time per block, min over the world's ranks. Every rank calls, same blocks (one
        all-reduce on the host world group)."""
        busy = torch.tensor(list(self.busy.values()), dtype=torch.float64, device="cpu")
        torch.distributed.all_reduce(busy, op=torch.distributed.ReduceOp.MIN, group=host_group())
        return {k: float(v) for k, v in zip(self.busy, busy, strict=True)}


def synthetic_samples(lengths: Sequence[int], vocab_size: int, seed: int) -> list[dict]:
    """RL samples (tokens, labels, loss_mask, advantages, old_logprobs) of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        tokens = torch.randint(0, vocab_size, (length + 1,), generator=gen)
        out.append(
            {
                "tokens": tokens[:-1].clone(),
                "labels": tokens[1:].clone(),
                "loss_mask": torch.ones(length),
                "advantages": torch.randn(length, generator=gen),
                "old_logprobs": torch.full((length,), -math.log(vocab_size)),
            }
        )
    return out


@dataclass(frozen=True)
class PhaseResult:
    """One measured phase run (the same on every rank)."""

    layout: str
    phase: str
    tokens: int
    """Tokens of the whole batch."""
    seconds: float
    """Phase time without CPU contention: min over ranks of wall time minus the time the rank's
    main thread was runnable but not running (``runqueue_wait_s``); equals wall time on an
    idle machine."""
    wall_seconds: float
    """Wall time of the phase, max over ranks."""
    peak_bytes: int
    """Measured peak (static + dynamic), max over ranks."""
    static_bytes: int
    """Measured static bytes on the rank with the peak."""
    metrics: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class PhaseRunner:
    """One model's state in the current layout, and measured phase runs (module docstring)."""

    def __init__(
        self,
        model: ModelConfig,
        budget: MemoryBudget | None = None,
        optim: OptimConfig | None = None,
        *,
        token_budget: int = 1024,
        logprob_chunk_size: int = 512,
        seed: int = 1,
    ) -> None:
        self.model = model
        self.budget = budget or MemoryBudget(1 << 50)
        self.optim = optim or OptimConfig(lr=1e-4)
        self.token_budget = token_budget
        self.logprob_chunk_size = logprob_chunk_size
        self.seed = seed
        self.layout: ParallelLayout | None = None
        self.chunks: list[Any] = []
        self.ddp: list[Any] = []
        self.optimizer: Any = None
        self.switch_seconds = 0.0

    # ------------------------------------------------------------------ layouts

    def switch(self, layout: ParallelLayout) -> None:
        """Make ``layout`` current, carrying weights and Adam moments over. Every rank calls."""
        from megatron_earl import runtime
        from megatron_earl.models.gpt import build_model
        from megatron_earl.parallel.state import use_layout
        from megatron_earl.redistribute.geometry import shard_pieces
        from megatron_earl.redistribute.optimizer_state import (
            init_adam_state,
            reshard_model_and_optimizer,
        )
        from megatron_earl.training.setup import build_optimizer, wire_schedule_hooks, wrap_ddp

        if layout == self.layout:
            use_layout(layout)
            return
        start = time.perf_counter()
        old_pieces = shard_pieces(self.chunks) if self.chunks else None
        old_optimizer = self.optimizer
        use_layout(layout)
        runtime.seed(self.seed)
        chunks = build_model(self.model, vpp=layout.vpp)
        ddp = wrap_ddp(chunks, self.optim)
        optimizer = build_optimizer(ddp, self.optim)
        wire_schedule_hooks(ddp, optimizer)
        init_adam_state(optimizer)
        if old_pieces is not None:
            reshard_model_and_optimizer(old_pieces, old_optimizer, shard_pieces(chunks), optimizer)
        self.layout, self.chunks, self.ddp, self.optimizer = layout, chunks, ddp, optimizer
        self.switch_seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ phases

    def micro_batch_tokens(self, samples: Sequence[dict]) -> int:
        """Per-rank token budget of a micro-batch (``rl_step``'s, after the CP split, as in the
        RL loop): ``token_budget``, or the rank's share of the longest sequence if larger."""
        cp = self.layout.cp
        longest = max(int(s["tokens"].numel()) for s in samples)
        own = cp_padded_length(longest, cp) // cp
        return max(self.token_budget, own)

    def run(self, phase: str, samples: Sequence[dict]) -> PhaseResult:
        """Run ``phase`` ("train" or "experience") on the whole batch ``samples`` (each DP rank
        takes its share), measured and budget-checked. Every rank calls."""
        from megatron.core import parallel_state

        from megatron_earl.training.rl_step import RLStepConfig, forward_logprobs, rl_train_step

        if self.layout is None:
            raise RuntimeError("PhaseRunner.run before switch(): no layout is current")
        dp_rank = parallel_state.get_data_parallel_rank()
        dp = parallel_state.get_data_parallel_world_size()
        if len(samples) < dp:
            raise ValueError(f"{len(samples)} samples cannot feed dp={dp} replicas")
        mine = samples[dp_rank::dp]
        max_tokens = self.micro_batch_tokens(samples)
        static = state_bytes(self.ddp, self.optimizer)
        torch.distributed.barrier()  # device world: on NCCL it also waits for queued device work
        start, waited = time.perf_counter(), runqueue_wait_s()
        with self.budget.track(static_bytes=static) as measured:
            if phase == Phase.TRAIN:
                config = RLStepConfig(
                    max_tokens_per_micro_batch=max_tokens,
                    logprob_chunk_size=self.logprob_chunk_size,
                )
                optimizer = self.budget.guard_optimizer(self.optimizer)
                metrics = rl_train_step(self.ddp, optimizer, mine, config)
            elif phase == Phase.EXPERIENCE:
                forward_logprobs(
                    self.chunks,
                    mine,
                    max_tokens=max_tokens,
                    chunk_size=self.logprob_chunk_size,
                    entropy=False,  # the loop's old/ref log-prob passes compute none
                )
                metrics = {}
                self.budget.checkpoint()
            else:
                raise ValueError(f"phase {phase!r}: PhaseRunner runs 'train' or 'experience'")
        wall, waited = time.perf_counter() - start, runqueue_wait_s() - waited
        mine = torch.tensor(
            [float(measured.peak_bytes), float(static), wall, wall - waited],
            dtype=torch.float64,
            device="cpu",
        )
        gathered = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, mine, group=host_group())
        top = max(gathered, key=lambda t: float(t[0]))
        return PhaseResult(
            layout=str(self.layout),
            phase=phase,
            tokens=sum(int(s["tokens"].numel()) for s in samples),
            seconds=min(float(t[3]) for t in gathered),
            wall_seconds=max(float(t[2]) for t in gathered),
            peak_bytes=int(top[0]),
            static_bytes=int(top[1]),
            metrics={k: float(v) for k, v in metrics.items()},
        )


def profile_layout(
    runner: PhaseRunner,
    table: ThroughputTable,
    phase: str,
    layout: ParallelLayout,
    lengths: Sequence[int],
    *,
    steps: int = 2,
    seed: int = 0,
) -> PhaseResult:
    """Run ``steps`` + 1 (warm-up) micro-steps of ``phase`` in ``layout`` on synthetic samples of
    ``lengths`` and record their tokens/s in ``table`` (bucket of the p95 length); returns the
    last run (its measured peak feeds ``calibrate.fit``). Every rank calls. The train steps
    update the weights: profile with a scratch runner."""
    from megatron_earl.selector.decide import percentile

    runner.switch(layout)
    samples = synthetic_samples(lengths, runner.model.vocab_size, seed)
    result = runner.run(phase, samples)  # warm-up: allocations, Adam state, group creation
    for _ in range(steps):
        result = runner.run(phase, samples)
        table.record(phase, layout, percentile(lengths, 0.95), result.tokens, result.seconds)
    return result
