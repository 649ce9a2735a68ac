"""``ParallelLayout``: an assignment of the world's ranks to TP x CP x PP x DP (pure, no processes).

Rank order is Megatron's default ``tp-cp-ep-dp-pp`` (tp varies fastest):

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))        (ep is reserved, = 1)

``groups(axis)`` lists the rank sets Megatron's ``initialize_model_parallel`` builds for that axis,
so the two can be checked against each other (tests/unit/test_layout.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_earl.config.model import ModelConfig

AXES = ("tp", "cp", "dp", "pp")
"""Mesh axes in Megatron's rank order, fastest first (ep reserved)."""


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
    """Expert-parallel size (reserved; must be 1)."""

    def __post_init__(self) -> None:
        sizes = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "ep": self.ep}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise LayoutError(f"parallel sizes must be integers >= 1, got {bad}")
        if self.ep != 1:
            raise LayoutError(f"ep={self.ep}: expert parallelism is reserved; use ep=1")
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

    def __str__(self) -> str:
        vpp = f"vpp{self.vpp}" if self.vpp else ""
        return f"tp{self.tp}cp{self.cp}pp{self.pp}{vpp}dp{self.dp}"

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Parse "tp2cp1pp1dp1" (any order, missing axes = 1) or "tp=2,dp=2"."""
        import re

        found = re.findall(r"(tp|cp|pp|dp|vpp|ep)\s*=?\s*(\d+)", text.lower())
        rest = re.sub(r"(tp|cp|pp|dp|vpp|ep)\s*=?\s*\d+|[\s,x]", "", text.lower())
        if not found or rest:
            raise LayoutError(f"cannot parse layout {text!r}; expected e.g. 'tp2pp1cp1dp2'")
        return cls(**{k: int(v) for k, v in found})

    # ------------------------------------------------------------------ validation

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise LayoutError(
                f"tp({self.tp}) * cp({self.cp}) * pp({self.pp}) * dp({self.dp}) = "
                f"{self.world_size} != world size ({world_size}); nearest valid: "
                f"{nearest_layout(self, world_size)}"
            )

    def check_model(self, model: ModelConfig) -> None:
        """Raise ``LayoutError`` if the model cannot be split this way (every reason at once)."""
        from megatron_earl.config.model import ModelConfigError

        try:
            model.validate_for_parallel(tp=self.tp, pp=self.pp, cp=self.cp, vpp=self.vpp)
        except ModelConfigError as err:
            raise LayoutError(f"layout {self}: {err}") from None

    def validate(self, world_size: int, model: ModelConfig | None = None) -> None:
        problems = []
        for check in (
            lambda: self.check_world(world_size),
            lambda: model is not None and self.check_model(model),
        ):
            try:
                check()
            except LayoutError as err:
                problems.append(str(err))
        if problems:
            raise LayoutError("; ".join(problems))

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


def nearest_layout(layout: ParallelLayout, world_size: int) -> ParallelLayout | None:
    """A valid layout for ``world_size`` that keeps tp, cp, pp where possible and adjusts dp."""
    mp = layout.tp * layout.cp * layout.pp
    if world_size % mp == 0:
        return ParallelLayout(
            tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=world_size // mp, vpp=layout.vpp
        )
    best = None
    for tp in _divisors(world_size):
        for cp in _divisors(world_size // tp):
            for pp in _divisors(world_size // (tp * cp)):
                cand = (abs(tp - layout.tp) + abs(cp - layout.cp) + abs(pp - layout.pp), tp, cp, pp)
                best = min(best, cand) if best else cand
    assert best is not None
    _, tp, cp, pp = best
    return ParallelLayout(tp=tp, cp=cp, pp=pp, dp=world_size // (tp * cp * pp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
