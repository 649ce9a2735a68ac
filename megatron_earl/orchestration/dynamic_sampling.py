"""Dynamic sampling of informative groups (``rollout.dynamic_sampling``; DAPO's filter, verl's
``filter_groups``, slime's over-sampling) in the synchronous loop.

    sampler = DynamicSampler(config)                                  # enabled only
    drawn, kept, sampling = sampler.fill(step, first_rollout, generate, min_samples)  # every rank
    metrics.update(sampling.metrics())

A group (the trajectories of one prompt) whose ``metric`` values span no more than ``tolerance``
has advantage exactly 0 under a group baseline and teaches nothing (``judge_group``). The step's
own prompts are rolled out as without dynamic sampling (round 0); while fewer than
``batch.prompts_per_step`` groups are informative, an extra round draws
``next_round_size`` more prompts -- the missing groups over the step's informative rate so far,
times ``oversample_factor`` -- until ``max_extra_rounds`` rounds or ``max_extra_prompts``
prompts. The step then trains on the first ``prompts_per_step`` informative groups in draw order
(``select_groups``; later ones are the surplus, dropped). A step that cannot fill trains on what
it has (a warning and ``dynamic_sampling/groups_missing`` say so); if its informative groups
cannot give every data-parallel rank a sample, uninformative groups in draw order fill up
(``groups_filler``, zero advantage: the zero-advantage skip leaves out what it can).

Determinism: step s's extra prompts are the environment seeds ``seed_offset + s x cap + k`` (its
own block: no step's draws change another's prompts, and a resumed step draws the same);
their group ids continue the step's numbering (``s<step>-<i>``, i >= prompts_per_step), so the
per-request sampling seeds (derived from the group id) are fixed too. Every rank computes the
same plan from the all-gathered verdicts.

Accounting (every step): drawn = kept + dropped; dropped = all_correct + all_wrong + other +
surplus; kept = informative kept + filler. The asynchronous producer filters the same way
(``orchestration.async_rollout``: its buffer admits informative groups only).

Which ranks call: ``DynamicSampler.fill`` every rank of the world (one object all-gather of the
round's verdicts on the host group per round, and the rollouts it runs); the rest is pure.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch.distributed as dist

from megatron_earl.config.dynamic_sampling import TOTAL_REWARD, DynamicSamplingConfig
from megatron_earl.config.run import RunConfig
from megatron_earl.orchestration.engines import Rollout
from megatron_earl.orchestration.rollout import PromptSet
from megatron_earl.parallel.groups import host_group
from megatron_earl.rollout.agent.trajectory import Trajectory

SUCCESS_REWARD = 1.0
"""A usable trajectory with at least this total reward is a success (as ``success_rate``)."""


class GroupVerdict(StrEnum):
    """What a group is worth to the update."""

    INFORMATIVE = "informative"
    """At least 2 usable trajectories whose metric spans more than the tolerance."""
    ALL_CORRECT = "all_correct"
    """Uninformative; every usable trajectory a success."""
    ALL_WRONG = "all_wrong"
    """Uninformative; no usable trajectory a success."""
    OTHER = "other"
    """Uninformative otherwise: successes and failures within the tolerance, or no usable
    trajectory."""


def metric_value(traj: Trajectory, metric: str) -> float:
    """``metric`` of one trajectory: the total reward or a named component."""
    return traj.reward if metric == TOTAL_REWARD else traj.rewards[metric]


def judge_group(trajectories: Sequence[Trajectory], metric: str, tolerance: float) -> GroupVerdict:
    """The verdict on one group's trajectories (failed ones are not usable). Pure."""
    usable = [t for t in trajectories if t.ok]
    values = [metric_value(t, metric) for t in usable]
    if len(values) >= 2 and max(values) - min(values) > tolerance:
        return GroupVerdict.INFORMATIVE
    successes = sum(t.reward >= SUCCESS_REWARD for t in usable)
    if usable and successes == len(usable):
        return GroupVerdict.ALL_CORRECT
    if usable and successes == 0:
        return GroupVerdict.ALL_WRONG
    return GroupVerdict.OTHER


@dataclass(frozen=True)
class GroupRecord:
    """One drawn group as the plan sees it (the same on every rank after the all-gather)."""

    index: int
    """Global group index in the step (draw order)."""
    verdict: GroupVerdict
    usable: int
    """Usable (OK) trajectories."""
    trajectories: int
    generated_tokens: int
    """Model-generated tokens of its trajectories (the generation it cost)."""


def group_number(group_id: str) -> int:
    """The index of group id ``<tag>-<i>``."""
    return int(group_id.rsplit("-", 1)[1])


def group_records(
    trajectories: Sequence[Trajectory], metric: str, tolerance: float
) -> list[GroupRecord]:
    """The records of the groups in ``trajectories`` (whole groups, one rank's). Pure."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return [
        GroupRecord(
            group_number(gid),
            judge_group(group, metric, tolerance),
            sum(t.ok for t in group),
            len(group),
            sum(sum(t.loss_mask) for t in group),
        )
        for gid, group in groups.items()
    ]


def next_round_size(
    ds: DynamicSamplingConfig,
    *,
    need: int,
    informative: int,
    drawn: int,
    extra_drawn: int,
    rounds: int,
    cap: int,
) -> int:
    """Prompts the next extra round draws: ceil(oversample_factor x missing / rate), rate =
    max(informative, 1) / drawn, within the cap of ``cap`` extra prompts; 0 when the step is
    full or a cap is reached (``rounds`` extra rounds done, ``extra_drawn`` prompts). Pure."""
    missing = need - informative
    if missing <= 0 or rounds >= ds.max_extra_rounds or extra_drawn >= cap:
        return 0
    want = math.ceil(ds.oversample_factor * missing * drawn / max(informative, 1))
    return min(want, cap - extra_drawn)


def extra_seeds(
    ds: DynamicSamplingConfig, step: int, cap: int, first: int, count: int
) -> tuple[int, ...]:
    """Environment seeds of step ``step``'s extra prompts ``first .. first + count - 1`` (its
    block of ``cap`` seeds from ``seed_offset``). Pure."""
    assert first + count <= cap, (first, count, cap)  # next_round_size keeps to the cap
    start = ds.seed_offset + step * cap + first
    return tuple(range(start, start + count))


@dataclass(frozen=True)
class Selection:
    kept: frozenset[int]
    """Indices of the groups the step trains on."""
    filler: int = 0
    """Of those, uninformative groups kept to give every data-parallel rank a sample."""


def select_groups(records: Sequence[GroupRecord], need: int, min_samples: int) -> Selection:
    """The first ``need`` informative groups in draw order; then, while they hold fewer than
    ``min_samples`` usable trajectories, uninformative groups with usable ones in draw order.
    Pure; the same on every rank."""
    ordered = sorted(records, key=lambda r: r.index)
    kept = [r for r in ordered if r.verdict == GroupVerdict.INFORMATIVE][:need]
    samples = sum(r.usable for r in kept)
    filler = 0
    for r in ordered:
        if samples >= min_samples:
            break
        if r.verdict != GroupVerdict.INFORMATIVE and r.usable:
            kept.append(r)
            samples += r.usable
            filler += 1
    return Selection(frozenset(r.index for r in kept), filler)


@dataclass(frozen=True)
class StepSampling:
    """What dynamic sampling did in one step (every rank holds the same)."""

    records: tuple[GroupRecord, ...]
    """Every drawn group, all rounds."""
    selection: Selection
    need: int
    """Informative groups the step wanted (``batch.prompts_per_step``)."""
    first_round: int
    """Groups of round 0 (the step's own prompts)."""
    extra_rounds: int

    @property
    def missing(self) -> int:
        """Informative groups short of ``need`` (0: the step filled)."""
        return self.need - (len(self.selection.kept) - self.selection.filler)

    def metrics(self) -> dict[str, float]:
        """``dynamic_sampling/*`` (``docs/metrics.md``). Pure."""
        kept = self.selection.kept
        dropped = [r for r in self.records if r.index not in kept]
        verdicts = [r.verdict for r in dropped]
        informative = sum(r.verdict == GroupVerdict.INFORMATIVE for r in self.records)
        extra = [r for r in self.records if r.index >= self.first_round]
        out = {
            "groups_drawn": len(self.records),
            "groups_kept": len(kept),
            "groups_dropped": len(dropped),
            "groups_dropped_all_correct": verdicts.count(GroupVerdict.ALL_CORRECT),
            "groups_dropped_all_wrong": verdicts.count(GroupVerdict.ALL_WRONG),
            "groups_dropped_other": verdicts.count(GroupVerdict.OTHER),
            "groups_surplus": verdicts.count(GroupVerdict.INFORMATIVE),
            "groups_filler": self.selection.filler,
            "groups_missing": self.missing,
            "extra_rounds": self.extra_rounds,
            "informative_fraction": informative / max(len(self.records), 1),
            "extra_trajectories": sum(r.trajectories for r in extra),
            "extra_generated_tokens": sum(r.generated_tokens for r in extra),
        }
        return {f"dynamic_sampling/{k}": float(v) for k, v in out.items()}


class UnfilledStepWarning(UserWarning):
    """A step could not fill its informative groups within the caps and trains on fewer."""


class DynamicSampler:
    """The synchronous loop's dynamic sampling (module docstring)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.ds = config.rollout.dynamic_sampling
        self.cap = self.ds.extra_prompt_cap(config.batch.prompts_per_step)
        """Extra prompts one step may draw."""

    def fill(
        self,
        step: int,
        first: Rollout,
        generate: Callable[[PromptSet], Rollout],
        min_samples: int,
    ) -> tuple[list[Trajectory], list[Trajectory], StepSampling]:
        """From round 0's rollout ``first`` (the step's own prompts), run extra rounds through
        ``generate`` while the step lacks informative groups; returns this rank's drawn and kept
        trajectories (draw order) and what happened. ``min_samples``: usable trajectories the
        step needs at least (one per data-parallel rank and mini-batch). Every rank calls."""
        cfg, ds = self.config, self.ds
        need = cfg.batch.prompts_per_step
        drawn_trajs = list(first.trajectories)
        records = self._gather(first.trajectories)
        rounds = extra_drawn = 0
        while True:
            informative = sum(r.verdict == GroupVerdict.INFORMATIVE for r in records)
            size = next_round_size(
                ds,
                need=need,
                informative=informative,
                drawn=need + extra_drawn,
                extra_drawn=extra_drawn,
                rounds=rounds,
                cap=self.cap,
            )
            if not size:
                break
            seeds = extra_seeds(ds, step, self.cap, extra_drawn, size)
            prompts = PromptSet(cfg.env.spec(), seeds, f"s{step}", first_index=need + extra_drawn)
            more = generate(prompts)
            assert more.source == first.source, (more.source, first.source)  # one layout
            drawn_trajs += more.trajectories
            records += self._gather(more.trajectories)
            rounds, extra_drawn = rounds + 1, extra_drawn + size
        selection = select_groups(records, need, min_samples)
        sampling = StepSampling(tuple(records), selection, need, need, rounds)
        if sampling.missing:
            warnings.warn(
                f"step {step}: dynamic sampling kept {need - sampling.missing} informative groups "
                f"of the {need} wanted after {rounds} extra rounds and {extra_drawn} "
                f"extra prompts (rollout.dynamic_sampling.max_extra_rounds="
                f"{ds.max_extra_rounds}, max_extra_prompts={self.cap}); the step trains on them"
                + (f" and {selection.filler} uninformative groups" if selection.filler else ""),
                UnfilledStepWarning,
                stacklevel=2,
            )
        kept = [t for t in drawn_trajs if group_number(t.group_id) in selection.kept]
        return drawn_trajs, kept, sampling

    def _gather(self, trajectories: Sequence[Trajectory]) -> list[GroupRecord]:
        """Every rank's records of a round's groups, by index. Collective (host world group)."""
        local = group_records(trajectories, self.ds.metric, self.ds.tolerance)
        gathered: list[list[GroupRecord] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local, group=host_group())
        return sorted((r for part in gathered for r in part or ()), key=lambda r: r.index)
