"""Start-up profiling of the selected phases in every candidate layout (EARL's short profiling
runs), before the first RL step.

    lines = profile_start_up(loop)        # every rank; rank 0 may print the lines

For each selected phase among experience and train (``RLLoop.selected``: not the experience
phase when it computes nothing), and each of its candidate layouts, the loop's
own phase function (``RLLoop.experience`` / ``RLLoop.train`` without the optimizer update: the
dispatch, the log-prob pass or forward + backward, the return path) runs on synthetic batches of
``batch.samples_per_step`` sequences of each ``selector.profile_lengths`` (one warm-up run first).
Each run is measured (``PhaseSelection.profile``: peak memory, busy seconds) and never refused, so
the memory model is calibrated per (phase, layout) and the throughput table holds measured cells
before the first decision. The weights and the optimizer state are unchanged (no update; the
train profile moves the master copy through the candidates and back, losslessly), and the run's
RNG streams are restored afterwards. The rollout phase is not profiled (on CPU its engine computes
in a worker thread the memory accounting does not see; its cells use the roofline).

Which ranks call: every rank of the world.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_earl import runtime
from megatron_earl.config.run import RunConfig
from megatron_earl.config.vocab import Phase
from megatron_earl.dispatch import Batch
from megatron_earl.orchestration.samples import SAMPLE_FIELDS, TOKEN_FIELDS
from megatron_earl.selector.memory import MiB
from megatron_earl.selector.profile import synthetic_samples

PROFILED_PHASES = (Phase.EXPERIENCE, Phase.TRAIN)


def default_profile_lengths(config: RunConfig) -> tuple[int, ...]:
    """Two sizes a quarter to twice a micro-batch apart: ``budget / (2 n)`` and ``2 budget / n``
    tokens per sequence for ``n`` sequences per step (a DP replica's micro-batch then spans from
    below the token budget to the full budget). Pure."""
    n = config.batch.samples_per_step
    budget = config.batch.max_tokens_per_micro_batch
    short = max(4, budget // (2 * n))
    return (short, max(2 * short, 2 * budget // n))


def synthetic_batch(
    lengths: Sequence[int], vocab_size: int, seed: int, *, old_logprobs: bool = False
) -> Batch:
    """This rank's share (sample i on rank i mod world) of ``selector.profile.synthetic_samples``
    as a batch with the RL step's fields (``rollout_logprobs`` = the uniform ``old_logprobs``).
    Local (every rank draws the same samples from ``seed``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = synthetic_samples(lengths, vocab_size, seed)
    mine = [i for i in range(len(lengths)) if i % world == rank]
    dtypes = {**TOKEN_FIELDS, "old_logprobs": torch.float32}
    names = [*TOKEN_FIELDS, *(["old_logprobs"] if old_logprobs else [])]
    source = {"rollout_logprobs": "old_logprobs"}
    packed = {
        n: torch.cat([samples[i][source.get(n, n)] for i in mine]).to(dtypes[n])
        if mine
        else torch.empty(0, dtype=dtypes[n])
        for n in names
    }
    return Batch(
        mine,
        [lengths[i] for i in mine],
        packed,
        {
            "reward": torch.zeros(len(mine), dtype=SAMPLE_FIELDS["reward"]),
            "policy_version": torch.zeros(len(mine), dtype=SAMPLE_FIELDS["policy_version"]),
        },
        group_ids=[i // 4 for i in mine],
    )


def profile_start_up(loop) -> list[str]:
    """Profile every selected experience/train candidate of ``loop`` (module docstring); returns
    one human line per measured run. Every rank calls."""
    selection, config = loop.selection, loop.config
    lengths_each = config.selector.profile_lengths or default_profile_lengths(config)
    n = config.batch.samples_per_step
    home = loop.policy.train_layout
    lines: list[str] = []
    start = time.perf_counter()
    with runtime.preserved_rng():
        for phase in PROFILED_PHASES:
            if not loop.selected(phase):
                continue
            for layout in selection.selectors[phase].candidates:
                for index, length in enumerate([lengths_each[0], *lengths_each]):
                    lengths = [length] * n
                    batch = synthetic_batch(
                        lengths,
                        config.model.vocab_size,
                        seed=index,
                        old_logprobs=phase == Phase.TRAIN and loop.old_logprobs,
                    )
                    if phase == Phase.EXPERIENCE:
                        loop.prepare(layout)
                        fn = lambda b=batch, lay=layout: loop.experience(b, lay)
                    else:
                        loop.move_master(layout)
                        fn = lambda b=batch, lay=layout: loop.train(b, lay, update=False)
                    static = loop.resident_bytes(layout)
                    peak, seconds = selection.profile(
                        phase,
                        layout,
                        lengths,
                        fn,
                        static=static,
                        train_layout=loop.policy.train_layout,
                        record=index > 0,  # the first run is a warm-up
                    )
                    if index > 0:
                        lines.append(
                            f"profile {phase:<10} {layout!s:<14} {n} x {length:>5} tokens: "
                            f"peak {peak / MiB:7.2f} MiB, {sum(lengths) / max(seconds, 1e-9):8.0f}"
                            " tok/s"
                        )
        loop.move_master(home)
    loop.release_unused()
    lines.append(
        f"profiled {len(lines)} runs in {time.perf_counter() - start:.1f} s; memory model "
        f"re-fitted on them ({len(selection.memory.settings.layout_fit)} (phase, layout) fits)"
    )
    return lines
