"""``ParallelLayout``: an assignment of the world's ranks to TP x CP x PP x DP (pure, no processes),
and of the same ranks to the expert layers' ETP x EP x EDP x PP.

Rank order is Megatron's default ``tp-cp-ep-dp-pp`` (tp varies fastest). The attention and dense
layers see

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

and the expert layers (megatron-core's second ``RankGenerator``) the same ranks of each pipeline
stage re-factored, so ep does not multiply the world size:

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank)),
    etp x ep x edp = tp x cp x dp        (etp = expert tensor parallelism, None = tp)

``groups(axis)`` / ``expert_groups(axis)`` list the rank sets Megatron's
``initialize_model_parallel`` builds for those axes, in Megatron's order; tests/unit/test_layout.py
checks them against megatron-core's ``RankGenerator`` over a table of sizes.

``validate(world_size, model, seq_length=...)`` raises one ``LayoutError`` that names every
problem (sizes vs world size, ep x etp vs tp x cp x dp, heads / query groups / FFN / vocab vs tp,
experts vs ep, expert FFN vs etp, layers vs pp x vpp, sequence length vs 2 x cp) and the nearest
valid layout.

``phase_layout(config.layouts, Phase.TRAIN)`` is the layout a run config gives a phase (the config
holds layout strings; their syntax is ``config.run.layout_sizes``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from megatron_earl.config.model import ModelConfig, ModelConfigError
from megatron_earl.config.run import ConfigError, LayoutsConfig, layout_sizes
from megatron_earl.config.vocab import Phase

AXES = ("tp", "cp", "dp", "pp")
"""Mesh axes of the attention and dense layers in Megatron's rank order, fastest first."""
EXPERT_AXES = ("etp", "ep", "edp", "pp")
"""Mesh axes of the expert layers in Megatron's rank order, fastest first (edp: expert data
parallelism, what is left of tp x cp x dp)."""


class LayoutError(ValueError):
    """An impossible layout; the message names every value involved and a valid alternative."""


@dataclass(frozen=True, order=True)
class Coord:
    """A rank's position in a layout."""

    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel axis; their product is the world size."""

    tp: int = 1
    """Tensor-parallel size."""
    cp: int = 1
    """Context-parallel size (sequence split in 2 x cp load-balanced chunks)."""
    pp: int = 1
    """Pipeline-parallel size."""
    dp: int = 1
    """Data-parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B), None for plain 1F1B."""
    ep: int = 1
    """Expert-parallel size: the experts of each MoE layer split over ep ranks, which are a
    re-factoring of the tp x cp x dp ranks of a pipeline stage (not an extra factor of the world
    size). 1 for dense models."""
    etp: int | None = None
    """Expert tensor-parallel size (each expert's FFN split over etp ranks); None means tp,
    megatron-core's default (a value equal to tp is stored as None)."""

    def __post_init__(self) -> None:
        sizes = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "ep": self.ep}
        bad = {k: v for k, v in sizes.items() if not _is_int(v) or v < 1}
        if self.vpp is not None and not _is_int(self.vpp):
            bad["vpp"] = self.vpp
        if self.etp is not None and (not _is_int(self.etp) or self.etp < 1):
            bad["etp"] = self.etp
        if bad:
            raise LayoutError(f"parallel sizes must be integers >= 1, got {bad}")
        if self.etp == self.tp:
            object.__setattr__(self, "etp", None)
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise LayoutError(
                f"vpp={self.vpp} with pp={self.pp}: virtual pipelining needs vpp >= 2 and pp >= 2 "
                "(or vpp=None)"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one copy of the model: tp x cp x pp."""
        return self.tp * self.cp * self.pp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (etp, or tp when unset)."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: tp x cp x dp / (ep x etp) (0 when that does not divide)."""
        ranks, split = self.tp * self.cp * self.dp, self.ep * self.expert_tp
        return ranks // split if ranks % split == 0 else 0

    def __str__(self) -> str:
        """Canonical form: ``tp{}cp{}pp{}[vpp{}]dp{}`` (its sizes multiply to the world size),
        then ``ep{}`` when ep > 1 and ``etp{}`` when etp is set: "tp1cp1pp1dp2ep2"."""
        vpp = f"vpp{self.vpp}" if self.vpp else ""
        ep = f"ep{self.ep}" if self.ep > 1 else ""
        etp = f"etp{self.etp}" if self.etp is not None else ""
        return f"tp{self.tp}cp{self.cp}pp{self.pp}{vpp}dp{self.dp}{ep}{etp}"

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Parse "tp2cp1pp1dp1" (any order, missing axes = 1; "tp1dp2ep2", "tp2dp2ep2etp1") or
        "tp=2,dp=2"."""
        try:
            return cls(**layout_sizes(text))
        except ConfigError as err:
            raise LayoutError(str(err)) from None

    # ------------------------------------------------------------------ validation

    def problems(
        self,
        world_size: int | None = None,
        model: ModelConfig | None = None,
        *,
        seq_length: int | None = None,
        pad_sequences: bool = False,
    ) -> list[str]:
        """Every reason this layout cannot run (empty when it can); each names the values involved.

        ``world_size``: ranks in the job. ``model``: the model to split (heads, query groups, FFN,
        padded vocab and layers must divide). ``seq_length``: the sequence length CP splits into
        2 x cp chunks; ``pad_sequences`` says the caller pads each sequence to a multiple of 2 x cp.
        """
        out = []
        if world_size is not None and self.world_size != world_size:
            out.append(
                f"tp({self.tp}) * cp({self.cp}) * pp({self.pp}) * dp({self.dp}) = "
                f"{self.world_size} != world size ({world_size})"
            )
        if not self.expert_dp:
            out.append(
                f"ep ({self.ep}) x etp ({self.expert_tp}) = {self.ep * self.expert_tp} does not "
                f"divide tp ({self.tp}) x cp ({self.cp}) x dp ({self.dp}) = "
                f"{self.tp * self.cp * self.dp}: the expert layers re-factor a pipeline stage's "
                "ranks (megatron-core: world size % (etp x ep x pp) == 0)"
            )
        if model is not None:
            if self.pp > model.num_layers:
                out.append(
                    f"pp ({self.pp}) > num_layers ({model.num_layers}): every pipeline stage "
                    "needs at least one layer"
                )
            out.extend(_model_problems(self, model))
        if seq_length is not None and self.cp > 1 and not pad_sequences:
            chunks = 2 * self.cp
            if seq_length % chunks:
                padded = -(-seq_length // chunks) * chunks
                out.append(
                    f"seq_length ({seq_length}) is not divisible by 2 x cp ({chunks}, "
                    f"cp={self.cp}) and padding is off: pad sequences to {padded} or enable "
                    "pad_sequences"
                )
        return out

    def validate(
        self,
        world_size: int | None = None,
        model: ModelConfig | None = None,
        *,
        seq_length: int | None = None,
        pad_sequences: bool = False,
    ) -> None:
        """Raise one ``LayoutError`` naming every problem and the nearest valid layout, if any."""
        problems = self.problems(
            world_size, model, seq_length=seq_length, pad_sequences=pad_sequences
        )
        if not problems:
            return
        message = f"layout {self} is impossible: " + "; ".join(problems)
        if world_size is not None:
            near = nearest_layout(
                self, world_size, model, seq_length=seq_length, pad_sequences=pad_sequences
            )
            message += f"; nearest valid layout: {near}" if near else "; no valid layout exists"
        raise LayoutError(message)

    def check_world(self, world_size: int) -> None:
        """Raise ``LayoutError`` unless the sizes multiply to ``world_size``."""
        self.validate(world_size)

    def check_model(self, model: ModelConfig) -> None:
        """Raise ``LayoutError`` if the model cannot be split this way (every reason at once)."""
        self.validate(None, model)

    # ------------------------------------------------------------------ rank math

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside layout {self} (world {self.world_size})")
        tp_rank, rest = rank % self.tp, rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        return Coord(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank)

    def rank(self, coord: Coord) -> int:
        return coord.tp + self.tp * (coord.cp + self.cp * (coord.dp + self.dp * coord.pp))

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def groups(self, axis: str | tuple[str, ...]) -> list[tuple[int, ...]]:
        """Rank sets that share every coordinate except those on ``axis`` (one or several axes)."""
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise LayoutError(f"unknown axis {unknown}; valid: {AXES}")
        fixed = [a for a in AXES if a not in axes]
        out = []
        for fixed_vals in itertools.product(*(range(self.size(a)) for a in fixed)):
            base = dict(zip(fixed, fixed_vals, strict=True))
            members = []
            for vals in itertools.product(*(range(self.size(a)) for a in reversed(axes))):
                c = dict(base)
                c.update(zip(reversed(axes), vals, strict=True))
                members.append(self.rank(Coord(**c)))
            out.append(tuple(sorted(members)))
        return sorted(out)

    def group_of(self, rank: int, axis: str | tuple[str, ...]) -> tuple[int, ...]:
        return next(g for g in self.groups(axis) if rank in g)

    def expert_groups(self, axis: str | tuple[str, ...]) -> list[tuple[int, ...]]:
        """Rank sets of the expert layers' ``axis`` (one or several of ``EXPERT_AXES``): "ep"
        is megatron-core's expert-model-parallel group, "etp" its expert-tensor-parallel group,
        ("etp", "ep") their joint group, "edp" the expert-data-parallel group (where expert
        gradients are reduced)."""
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        unknown = [a for a in axes if a not in EXPERT_AXES]
        if unknown:
            raise LayoutError(f"unknown expert axis {unknown}; valid: {EXPERT_AXES}")
        if not self.expert_dp:
            raise LayoutError(f"layout {self}: " + self.problems()[0])
        etp, ep, edp = self.expert_tp, self.ep, self.expert_dp
        sizes = {"etp": etp, "ep": ep, "edp": edp, "pp": self.pp}
        strides = {"etp": 1, "ep": etp, "edp": etp * ep, "pp": etp * ep * edp}
        fixed = [a for a in EXPERT_AXES if a not in axes]
        out = []
        for fixed_vals in itertools.product(*(range(sizes[a]) for a in fixed)):
            base = sum(strides[a] * v for a, v in zip(fixed, fixed_vals, strict=True))
            members = [
                base + sum(strides[a] * v for a, v in zip(axes, vals, strict=True))
                for vals in itertools.product(*(range(sizes[a]) for a in axes))
            ]
            out.append(tuple(sorted(members)))
        return sorted(out)

    def embedding_groups(self) -> list[tuple[int, ...]]:
        """First and last stage of each pipeline (Megatron's embedding groups; tied weights)."""
        return [tuple(dict.fromkeys((g[0], g[-1]))) for g in self.groups("pp")]

    def position_embedding_groups(self) -> list[tuple[int, ...]]:
        """First stage of each pipeline (Megatron's position-embedding groups)."""
        return [(g[0],) for g in self.groups("pp")]


def phase_layout(layouts: LayoutsConfig, phase: Phase) -> ParallelLayout:
    """The ``ParallelLayout`` a run config's ``layouts`` section gives ``phase``; raises
    ``ConfigError`` for an unknown phase, ``LayoutError`` for impossible sizes."""
    return ParallelLayout.parse(layouts.of(phase))


def nearest_layout(
    layout: ParallelLayout,
    world_size: int,
    model: ModelConfig | None = None,
    *,
    seq_length: int | None = None,
    pad_sequences: bool = False,
) -> ParallelLayout | None:
    """The valid layout for ``world_size`` (and model / sequence length) closest to ``layout``.

    Distance: sum over tp, cp, pp, dp of |log2(new / old)|, plus 1 if vpp must be dropped, plus
    |log2| of the ep change and 1 if etp must be dropped (ep and etp are kept, or ep falls back to
    1 and etp to tp); ties keep tp, then cp, then pp unchanged. None when no layout fits.
    """
    best: tuple | None = None
    for tp in _divisors(world_size):
        for cp in _divisors(world_size // tp):
            for pp in _divisors(world_size // (tp * cp)):
                dp = world_size // (tp * cp * pp)
                for vpp, ep, etp in itertools.product(
                    dict.fromkeys((layout.vpp, None)),
                    dict.fromkeys((layout.ep, 1)),
                    dict.fromkeys((layout.etp, None)),
                ):
                    if vpp is not None and pp < 2:
                        continue
                    cand = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp, vpp=vpp, ep=ep, etp=etp)
                    if cand.problems(
                        world_size, model, seq_length=seq_length, pad_sequences=pad_sequences
                    ):
                        continue
                    moves = [abs(math.log2(getattr(cand, a) / getattr(layout, a))) for a in AXES]
                    expert = math.log2(layout.ep / ep) + (etp != layout.etp)
                    score = (
                        sum(moves) + (vpp != layout.vpp) + expert,
                        moves[0],
                        moves[1],
                        moves[3],
                        (tp, cp, pp),
                    )
                    if best is None or score < best[0]:
                        best = (score, cand)
    return best[1] if best else None


def _model_problems(layout: ParallelLayout, model: ModelConfig) -> list[str]:
    """The model's own divisibility checks (``ModelConfig.validate_for_parallel``): one message
    listing every failed check, or nothing."""
    try:
        model.validate_for_parallel(
            tp=layout.tp, pp=layout.pp, cp=layout.cp, vpp=layout.vpp, ep=layout.ep, etp=layout.etp
        )
    except ModelConfigError as err:
        return [str(err).removeprefix("model does not fit the parallel layout: ")]
    return []


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
