"""What a dispatch is planned from (pure data): each rank's holdings (``SourceMeta``), where the
batch goes (``Destination``), how to balance, micro-batch and route (``PlanConfig``), and which
token spans a CP rank receives (``cp_real_spans``). The planner is ``dispatch.plan``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_earl.config.vocab import PHASES, Phase
from megatron_earl.dispatch.batch import Schema
from megatron_earl.dispatch.route import DispatchError, RouteConfig
from megatron_earl.parallel.cp import cp_chunk_bounds
from megatron_earl.parallel.layout import ParallelLayout

# ---------------------------------------------------------------------- context-parallel chunks


def cp_real_spans(seq_len: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """``cp_chunk_bounds`` clipped to the real tokens, empty ranges dropped (what is sent)."""
    spans = [(a, min(b, seq_len)) for a, b in cp_chunk_bounds(seq_len, cp, cp_rank)]
    return [(a, b) for a, b in spans if b > a]


# ---------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class SourceMeta:
    """What one rank holds before the dispatch (all-gathered, so every rank sees all of them)."""

    sample_ids: tuple[int, ...] = ()
    """Global ids of the samples this rank holds (a sample held by several ranks is a replica)."""
    lengths: tuple[int, ...] = ()
    """Their lengths in tokens."""
    group_ids: tuple[int, ...] = ()
    """Their groups (samples of one prompt)."""


@dataclass(frozen=True)
class Destination:
    """Where the batch goes: a layout, a phase, and which fields each pipeline stage reads."""

    layout: ParallelLayout
    """The consuming layout."""
    phase: Phase = Phase.TRAIN
    """One of ``PHASES`` (recorded in the plan; the stage fields below carry the behaviour)."""
    first_stage_fields: tuple[str, ...] = ("tokens",)
    """Fields the first pipeline stage reads (the embedding input)."""
    last_stage_fields: tuple[str, ...] | None = None
    """Fields the last stage reads (targets, masks, log-probs, advantages); None = every field."""
    middle_stage_fields: tuple[str, ...] = ()
    """Fields the stages between the first and the last read (none for a plain forward; a
    consumer that plans micro-batches on every stage needs at least the lengths' carrier)."""

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise DispatchError(f"phase {self.phase!r} is not one of {PHASES}")

    def stage_fields(self, schema: Schema, pp_rank: int) -> tuple[str, ...]:
        """Names of the fields pipeline stage ``pp_rank`` receives (middle stages: none)."""
        names = [s.name for s in schema]
        last = tuple(names) if self.last_stage_fields is None else self.last_stage_fields
        for label, wanted in (
            ("first_stage_fields", self.first_stage_fields),
            ("last_stage_fields", last),
            ("middle_stage_fields", self.middle_stage_fields),
        ):
            missing = sorted(set(wanted) - set(names))
            if missing:
                raise DispatchError(f"{label} names {missing}, not in the batch; fields: {names}")
        chosen: set[str] = set()
        if pp_rank == 0:
            chosen |= set(self.first_stage_fields)
        if pp_rank == self.layout.pp - 1:
            chosen |= set(last)
        if 0 < pp_rank < self.layout.pp - 1:
            chosen |= set(self.middle_stage_fields)
        return tuple(n for n in names if n in chosen)


@dataclass(frozen=True)
class PlanConfig:
    """How to balance, micro-batch and route."""

    max_tokens_per_micro_batch: int | None = None
    """Per-rank token budget of one micro-batch (tokens a rank holds: padded length / cp); None =
    one micro-batch per DP rank. A sample above it is an error (see docs/dispatch.md)."""
    attention_weight: float = 0.0
    """Balancing cost of a sample is ``len + attention_weight * len**2 / 1024``; 0 balances tokens,
    > 0 also balances quadratic attention work of long sequences."""
    keep_groups: bool = False
    """Keep all samples of a group on the same DP rank (e.g. group-normalised losses)."""
    prefer_groups: bool = False
    """Keep a group's samples on one DP rank when there are at least 2 groups per DP rank
    (``balance.PREFER_GROUPS_PER_RANK``), else balance samples (prefix-shared packing: sharing
    a group's prompt is a gain, not a requirement)."""
    route: RouteConfig = field(default_factory=RouteConfig)
    """Source choice and TP fan-out (see ``route.RouteConfig``)."""
    num_mini_batches: int = 1
    """Mini-batches (optimizer steps) each DP rank's micro-batches are grouped into."""
    consumer_cp: int | None = None
    """Context-parallel size the consumer splits the micro-batches over itself when every rank of
    a replica receives whole samples (CP folded into TP, ``orchestration.samples.replica_layout``):
    the budget then counts ``cp_padded_length(len, consumer_cp) / consumer_cp`` tokens per sample.
    None: the destination layout's cp."""

    def __post_init__(self) -> None:
        if self.num_mini_batches < 1:
            raise DispatchError(f"num_mini_batches={self.num_mini_batches}; use >= 1")
        if self.consumer_cp is not None and self.consumer_cp < 1:
            raise DispatchError(f"consumer_cp={self.consumer_cp}; use >= 1 or None")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise DispatchError(
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}; use >= 1 or None"
            )
        if self.attention_weight < 0:
            raise DispatchError(f"attention_weight={self.attention_weight}; use >= 0")

    def cost(self, length: float | np.ndarray) -> float | np.ndarray:
        """A sample's balance cost: its tokens plus ``attention_weight`` x tokens^2 / 1024
        (elementwise on an array of lengths)."""
        return length + self.attention_weight * length * length / 1024
