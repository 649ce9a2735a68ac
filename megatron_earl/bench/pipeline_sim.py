"""A discrete-event simulator of the RL pipeline: sync vs async (staleness k), partial rollouts.

    config = SimConfig(num_engines=4, slots_per_engine=16, decode_s_per_token=0.02,
                       lengths=LengthDist.lognormal(median=256, sigma=1.0, max_tokens=4096),
                       prompts_per_step=8, group_size=4, train_s_per_token=1e-4, push_s=2.0,
                       mode="async", max_staleness=1, partial_rollout="continue")
    result = simulate(config)      # SimResult: throughput, trainer idle, staleness, waste
    result.to_dict()

Pure Python (no torch), deterministic given ``seed``. Every input is a figure one can measure
on the real system (the paced benchmark fills them: per-token decode time, env step time,
trajectory lengths, train time per token, weight-push time), so the simulator can be checked
against a measurement before it is used to project.

The model (docs/async.md has the assumptions in full):

- **Engines** (``num_engines``), each decoding up to ``slots_per_engine`` trajectories together
  with continuous batching: one decode step gives every running trajectory one token and lasts
  ``decode_s_per_token * (1 + batch_slope * (running - 1))``; a trajectory that arrives joins at
  the next step boundary; more trajectories wait in the engine's FIFO queue. A trajectory is
  placed, when its group starts, on the engine with the fewest unfinished trajectories and stays
  there (session affinity). Prefill is not modelled separately (fold it into ``env_step_s``).
- **Trajectories**: ``lengths`` gives each one's generated tokens (the i-th trajectory created
  gets the i-th draw, the same in every mode); they come in turns of ``tokens_per_turn``
  tokens, with an environment/tool step of ``env_step_s`` between turns, during which the
  trajectory holds no slot. A group is ``group_size`` trajectories of one prompt; it is ready
  when all of them are.
- **Trainer**: a step trains ``prompts_per_step`` groups in ``train_s_fixed +
  train_s_per_token * tokens`` (tokens: generated + ``prompt_tokens`` per trajectory), then
  pushes weights in ``push_s``; the weight version (v) increments when the push ends. During a
  push every engine is paused (pause -> update -> continue).
- **sync**: a step starts its groups, waits for the last trajectory, trains, pushes; no overlap.
- **async**: groups start whenever AReaL's rule allows -- groups started and not discarded <=
  (v + max_staleness + 1) * prompts_per_step -- and the trainer takes the first
  ``prompts_per_step`` ready groups as soon as it is free. At consumption a group with a
  trajectory whose oldest token's version < v - max_staleness is discarded (counted, its tokens
  wasted) and replaced. ``partial_rollout``: ``continue`` -- in-flight trajectories go on after
  the push with the new weights (earlier tokens keep their version); ``restart`` -- they are
  aborted at the push (their tokens wasted) and start again from scratch after it.
  With max_staleness 0 the async schedule is the sync one (a test checks it).

A pause preempts a running decode step (the partial step is redone after the push); all times
are seconds.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class SimMode(StrEnum):
    """Schedule of the simulated loop (the values of ``rollout.mode``)."""

    SYNC = "sync"
    ASYNC = "async"


class PartialRollout(StrEnum):
    """What a weight update does to in-flight trajectories (``rollout.partial_rollout``)."""

    CONTINUE = "continue"
    RESTART = "restart"


class LengthKind(StrEnum):
    FIXED = "fixed"
    LOGNORMAL = "lognormal"
    PARETO = "pareto"
    EMPIRICAL = "empirical"
    SEQUENCE = "sequence"


@dataclass(frozen=True)
class LengthDist:
    """Generated tokens per trajectory: fixed, lognormal, Pareto, drawn from measured values, or
    a measured run replayed in order; draws are rounded and clipped to [1, ``max_tokens``]."""

    kind: LengthKind
    """fixed | lognormal | pareto | empirical | sequence."""
    scale: float = 0.0
    """fixed: the length; lognormal: the median; pareto: the minimum (x_m)."""
    shape: float = 0.0
    """lognormal: sigma of log-length; pareto: alpha (tail index; smaller = longer tail)."""
    values: tuple[int, ...] = ()
    """empirical: the measured lengths, drawn uniformly with replacement; sequence: the lengths
    of a measured run in creation order (trajectory i gets ``values[i % len(values)]``)."""
    max_tokens: int | None = None
    """Clip (a context limit); None: unclipped."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LengthKind(self.kind))
        if self.kind in (LengthKind.EMPIRICAL, LengthKind.SEQUENCE):
            if not self.values or min(self.values) < 1:
                raise ValueError(
                    f"{self.kind} lengths need values >= 1, got {list(self.values)[:8]}"
                )
        elif not self.scale >= 1:
            raise ValueError(f"{self.kind} lengths need scale >= 1 token, got {self.scale}")
        if self.kind in (LengthKind.LOGNORMAL, LengthKind.PARETO) and not self.shape > 0:
            raise ValueError(f"{self.kind} lengths need shape > 0, got {self.shape}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")

    @classmethod
    def fixed(cls, tokens: int) -> LengthDist:
        return cls(LengthKind.FIXED, scale=tokens)

    @classmethod
    def lognormal(cls, median: float, sigma: float, max_tokens: int | None = None) -> LengthDist:
        return cls(LengthKind.LOGNORMAL, scale=median, shape=sigma, max_tokens=max_tokens)

    @classmethod
    def pareto(cls, minimum: float, alpha: float, max_tokens: int | None = None) -> LengthDist:
        return cls(LengthKind.PARETO, scale=minimum, shape=alpha, max_tokens=max_tokens)

    @classmethod
    def empirical(cls, values: list[int] | tuple[int, ...]) -> LengthDist:
        return cls(LengthKind.EMPIRICAL, values=tuple(int(v) for v in values))

    @classmethod
    def sequence(cls, values: list[int] | tuple[int, ...]) -> LengthDist:
        return cls(LengthKind.SEQUENCE, values=tuple(int(v) for v in values))

    def sample(self, rng: random.Random, index: int) -> int:
        """The length of trajectory ``index`` (the index matters only for ``sequence``)."""
        if self.kind is LengthKind.FIXED:
            x = self.scale
        elif self.kind is LengthKind.LOGNORMAL:
            x = self.scale * math.exp(rng.gauss(0.0, self.shape))
        elif self.kind is LengthKind.PARETO:
            x = self.scale * rng.paretovariate(self.shape)
        elif self.kind is LengthKind.EMPIRICAL:
            x = rng.choice(self.values)
        else:
            x = self.values[index % len(self.values)]
        x = max(1, round(x))
        return x if self.max_tokens is None else min(x, self.max_tokens)

    def describe(self, num_samples: int = 20000, seed: int = 0) -> dict[str, Any]:
        """The distribution's parameters and the quantiles of ``num_samples`` seeded draws."""
        rng = random.Random(seed)
        if self.kind is LengthKind.SEQUENCE:
            num_samples = len(self.values)
        draws = sorted(self.sample(rng, i) for i in range(num_samples))

        def q(p: float) -> int:
            return draws[min(len(draws) - 1, int(p * len(draws)))]

        params = {"kind": str(self.kind), "max_tokens": self.max_tokens}
        if self.kind in (LengthKind.EMPIRICAL, LengthKind.SEQUENCE):
            params["num_values"] = len(self.values)
        else:
            params |= {"scale": self.scale, "shape": self.shape}
        return params | {
            "mean": sum(draws) / len(draws),
            "p50": q(0.5),
            "p90": q(0.9),
            "p99": q(0.99),
            "max": draws[-1],
            "p99_over_p50": q(0.99) / q(0.5),
        }


@dataclass(frozen=True)
class SimConfig:
    """One simulated pipeline: engines, workload, trainer and schedule (seconds, tokens)."""

    num_engines: int
    """Rollout engines (each one model replica, e.g. an SGLang server)."""
    slots_per_engine: int
    """Trajectories one engine decodes together at most (its running batch)."""
    decode_s_per_token: float
    """Wall time of one decode step with one running trajectory (one token each)."""
    lengths: LengthDist
    """Generated tokens per trajectory."""
    batch_slope: float = 0.0
    """Decode step time grows by this fraction per extra running trajectory (0: flat)."""
    tokens_per_turn: int | None = None
    """Generated tokens per model turn (the last turn takes the rest); None: one turn."""
    env_step_s: float = 0.0
    """Environment / tool time between two turns (no engine slot held)."""
    prefill_s: float | None = None
    """None: prefill not modelled (a turn of t tokens is t decode steps; fold prefill time into
    ``env_step_s``). A number: trajectories joining an engine are prefilled together in one
    forward of this many seconds that blocks the engine and yields each one's first token of
    the turn (then t - 1 decode steps), as the embedded engine and SGLang do."""
    prompt_tokens: int = 0
    """Prompt tokens per trajectory (trained on, not generated)."""
    group_size: int = 1
    """Trajectories per prompt (a GRPO group)."""
    prompts_per_step: int = 1
    """Groups per training step (B)."""
    train_s_fixed: float = 0.0
    """Trainer time per step independent of the batch (optimizer, experience overheads)."""
    train_s_per_token: float = 0.0
    """Trainer time per trained token (experience log-probs + forward/backward)."""
    push_s: float = 0.0
    """Weight push: the trainer is blocked this long after each step."""
    engine_pause_s: float | None = None
    """How long every engine is paused by the push (None: ``push_s``, a direct push to every
    engine). A relay weight service (docs/relay.md) blocks the trainer only for its publish
    (``push_s``) and pauses each engine for its own load (``engine_pause_s``)."""
    mode: SimMode = SimMode.SYNC
    """sync | async."""
    max_staleness: int = 0
    """async: AReaL's k (see the module docstring)."""
    partial_rollout: PartialRollout = PartialRollout.CONTINUE
    """async: continue | restart in-flight trajectories at a weight update."""
    num_steps: int = 10
    """Training steps simulated."""
    seed: int = 0
    """Seed of the length draws."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", SimMode(self.mode))
        object.__setattr__(self, "partial_rollout", PartialRollout(self.partial_rollout))
        bad = [
            f"{name}={getattr(self, name)} (must be >= 1)"
            for name in (
                "num_engines",
                "slots_per_engine",
                "group_size",
                "prompts_per_step",
                "num_steps",
            )
            if getattr(self, name) < 1
        ]
        bad += [
            f"{name}={getattr(self, name)} (must be >= 0)"
            for name in (
                "batch_slope",
                "env_step_s",
                "prompt_tokens",
                "train_s_fixed",
                "train_s_per_token",
                "push_s",
                "max_staleness",
            )
            if not getattr(self, name) >= 0
        ]
        if not self.decode_s_per_token > 0:
            bad.append(f"decode_s_per_token={self.decode_s_per_token} (must be > 0)")
        if self.engine_pause_s is not None and not self.engine_pause_s >= 0:
            bad.append(f"engine_pause_s={self.engine_pause_s} (must be >= 0 or None)")
        if self.prefill_s is not None and not self.prefill_s >= 0:
            bad.append(f"prefill_s={self.prefill_s} (must be >= 0 or None)")
        if self.tokens_per_turn is not None and self.tokens_per_turn < 1:
            bad.append(f"tokens_per_turn={self.tokens_per_turn} (must be >= 1 or None)")
        if bad:
            raise ValueError("bad simulator config: " + "; ".join(bad))

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SimConfig:
        """From JSON (e.g. filled from a measured run): ``SimConfig``'s field names; ``lengths``
        is a list of measured lengths (drawn from), ``{"kind": "sequence", "values": [...]}``
        (a run replayed in order) or ``{"kind", "scale", "shape", "max_tokens"}``. An unknown
        field is an error that names it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown simulator fields {unknown}; valid: {sorted(known)}")
        lengths = fields.get("lengths")
        if isinstance(lengths, list):
            lengths = LengthDist.empirical(lengths)
        elif isinstance(lengths, dict):
            try:
                lengths = LengthDist(**lengths | {"values": tuple(lengths.get("values", ()))})
            except TypeError as err:
                raise ValueError(f"lengths {lengths}: {err}") from None
        else:
            raise ValueError(
                f"lengths must be a list of token counts or a distribution dict, got {lengths!r}"
            )
        return cls(**(fields | {"lengths": lengths}))

    def step_s(self, running: int) -> float:
        """Wall time of one decode step of ``running`` trajectories."""
        return self.decode_s_per_token * (1.0 + self.batch_slope * (running - 1))

    def train_s(self, tokens: int) -> float:
        return self.train_s_fixed + self.train_s_per_token * tokens


@dataclass
class SimResult:
    """What a simulation measured (``to_dict`` for JSON)."""

    config: SimConfig
    duration_s: float = 0.0
    """From the start to the end of the last step's push."""
    trained_trajectories: int = 0
    trained_tokens: int = 0
    """Generated tokens of the trained trajectories."""
    generated_tokens: int = 0
    """Every token the engines generated (trained, discarded, wasted by restarts, in flight)."""
    discarded_trajectories: int = 0
    """Too stale at consumption (async), never trained on."""
    discarded_tokens: int = 0
    restarted_trajectories: int = 0
    """Aborted by a weight update and started again (``restart``)."""
    wasted_tokens: int = 0
    """Tokens thrown away by those restarts."""
    left_over_tokens: int = 0
    """Tokens of trajectories not trained at the end (in flight or ready): generated ==
    trained + discarded + wasted + left over."""
    trainer_wait_s: float = 0.0
    """Trainer waiting for a batch (neither training nor pushing)."""
    train_s: float = 0.0
    push_s: float = 0.0
    engine_busy_s: float = 0.0
    """Engine-seconds spent decoding (summed over engines)."""
    step_end_s: list[float] = field(default_factory=list)
    """When each step's push ended."""
    step_wait_s: list[float] = field(default_factory=list)
    """``trainer_wait_s`` so far at each step's end (steady-state idle fractions)."""
    staleness_trajectories: Counter = field(default_factory=Counter)
    """Version lag of each trained trajectory's oldest token -> count."""
    staleness_tokens: Counter = field(default_factory=Counter)
    """Version lag of each trained token -> count."""

    def to_dict(self) -> dict[str, Any]:
        d = self.duration_s
        cfg = self.config
        return {
            "mode": str(cfg.mode),
            "max_staleness": cfg.max_staleness if cfg.mode is SimMode.ASYNC else None,
            "partial_rollout": str(cfg.partial_rollout) if cfg.mode is SimMode.ASYNC else None,
            "steps": cfg.num_steps,
            "duration_s": d,
            "s_per_step": d / cfg.num_steps,
            "trajectories_per_s": self.trained_trajectories / d,
            "tokens_per_s": self.trained_tokens / d,
            "trainer_idle_fraction": self.trainer_wait_s / d,
            "train_fraction": self.train_s / d,
            "push_fraction": self.push_s / d,
            "engine_utilization": self.engine_busy_s / (d * cfg.num_engines),
            "trained_trajectories": self.trained_trajectories,
            "trained_tokens": self.trained_tokens,
            "generated_tokens": self.generated_tokens,
            "discarded_trajectories": self.discarded_trajectories,
            "discarded_tokens": self.discarded_tokens,
            "restarted_trajectories": self.restarted_trajectories,
            "wasted_tokens": self.wasted_tokens,
            "left_over_tokens": self.left_over_tokens,
            "staleness_trajectories": dict(sorted(self.staleness_trajectories.items())),
            "staleness_tokens": dict(sorted(self.staleness_tokens.items())),
        }


def simulate(config: SimConfig) -> SimResult:
    """Run ``config`` for ``num_steps`` training steps (deterministic)."""
    return _Simulation(config).run()


def _split_turns(tokens: int, per_turn: int | None) -> list[int]:
    if per_turn is None:
        return [tokens]
    return [per_turn] * (tokens // per_turn) + ([tokens % per_turn] if tokens % per_turn else [])


# ---------------------------------------------------------------------- the event simulation


@dataclass(eq=False)
class _Group:
    index: int
    trajectories: list[_Trajectory] = field(default_factory=list)
    num_done: int = 0


@dataclass(eq=False)
class _Trajectory:
    index: int
    group: _Group
    turns: list[int]
    """Tokens of each model turn."""
    engine: _Engine
    turn: int = 0
    """The turn being generated (or awaited); == len(turns) when done."""
    generated: int = 0
    """Tokens of this attempt credited so far."""
    versions: Counter = field(default_factory=Counter)
    """Weight version -> tokens of this attempt generated with it."""
    credited_step: int = 0
    """The engine's step count up to which this trajectory's tokens are credited."""
    attempt: int = 0
    """Bumped by a restart: events of an earlier attempt are ignored."""


@dataclass(eq=False)
class _Engine:
    index: int
    steps: int = 0
    """Decode steps run so far."""
    last: float = 0.0
    """Time of the last step boundary credited (``steps`` refers to it)."""
    running: dict[_Trajectory, None] = field(default_factory=dict)
    ends: list[tuple[int, int, _Trajectory]] = field(default_factory=list)
    """Heap of (step count at which a running trajectory's turn ends, index, trajectory)."""
    queue: deque[_Trajectory] = field(default_factory=deque)
    load: int = 0
    """Unfinished trajectories placed here (placement key)."""
    paused: bool = False
    generation: int = 0
    """Bumped to cancel the scheduled engine event."""
    scheduled: float | None = None
    busy_s: float = 0.0


class _Simulation:
    """One run of ``SimConfig`` (see the module docstring for the model)."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.result = SimResult(config)
        self.engines = [_Engine(i) for i in range(config.num_engines)]
        self.loads = [(0, i) for i in range(config.num_engines)]
        """Heap of (load, engine index); entries whose load is outdated are skipped."""
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.version = 0
        """Published weight version (== training steps whose push has ended)."""
        self.num_trajectories = 0
        self.groups_started = 0
        self.groups_discarded = 0
        self.ready: deque[_Group] = deque()
        self.unfinished: dict[_Trajectory, None] = {}
        self.live_groups: dict[_Group, None] = {}
        """Groups started and neither trained nor discarded."""
        self.trainer_busy = False
        self.trainer_free_since = 0.0

    def run(self) -> SimResult:
        self._start_groups()
        handlers = {
            "engine": self._on_engine,
            "env": self._on_env,
            "train_done": self._on_train_done,
            "push_done": self._on_push_done,
            "engines_resume": self._on_engines_resume,
        }
        while len(self.result.step_end_s) < self.cfg.num_steps:
            assert self.events, "simulation stalled"  # every started group finishes
            self.now, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](payload)
        self.result.duration_s = self.result.step_end_s[-1]
        self.result.engine_busy_s = sum(e.busy_s for e in self.engines)
        self.result.left_over_tokens = sum(
            t.generated for g in self.live_groups for t in g.trajectories
        )
        return self.result

    def _at(self, time: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (time, next(self.seq), kind, payload))

    # ------------------------------------------------------------------ controller

    def _start_groups(self) -> None:
        """sync: the step's groups; async: as many as the staleness rule allows."""
        cfg = self.cfg
        if cfg.mode is SimMode.SYNC:
            limit = self.groups_started + cfg.prompts_per_step
        else:
            limit = (self.version + cfg.max_staleness + 1) * cfg.prompts_per_step
            limit += self.groups_discarded
        while self.groups_started < limit:
            self._start_group()

    def _start_group(self) -> None:
        group = _Group(self.groups_started)
        self.groups_started += 1
        self.live_groups[group] = None
        for _ in range(self.cfg.group_size):
            engine = self._least_loaded()
            self._add_load(engine, 1)
            tokens = self.cfg.lengths.sample(self.rng, self.num_trajectories)
            traj = _Trajectory(
                self.num_trajectories, group, _split_turns(tokens, self.cfg.tokens_per_turn), engine
            )
            self.num_trajectories += 1
            group.trajectories.append(traj)
            self.unfinished[traj] = None
            self._arrive(traj)

    def _least_loaded(self) -> _Engine:
        """The engine with the fewest unfinished trajectories (lowest index on ties)."""
        while True:
            load, index = self.loads[0]
            if self.engines[index].load == load:
                return self.engines[index]
            heapq.heappop(self.loads)  # an outdated entry

    def _add_load(self, engine: _Engine, delta: int) -> None:
        engine.load += delta
        heapq.heappush(self.loads, (engine.load, engine.index))

    def _finish(self, traj: _Trajectory) -> None:
        self._add_load(traj.engine, -1)
        del self.unfinished[traj]
        group = traj.group
        group.num_done += 1
        if group.num_done == self.cfg.group_size:
            self.ready.append(group)
            self._try_train()

    def _try_train(self) -> None:
        """Take a batch if the trainer is free: async discards stale ready groups first."""
        cfg = self.cfg
        if self.trainer_busy:
            return
        if cfg.mode is SimMode.ASYNC:
            oldest_allowed = self.version - cfg.max_staleness
            for group in [g for g in self.ready if _oldest(g) < oldest_allowed]:
                self.ready.remove(group)
                del self.live_groups[group]
                self.groups_discarded += 1
                self.result.discarded_trajectories += len(group.trajectories)
                self.result.discarded_tokens += sum(t.generated for t in group.trajectories)
            self._start_groups()  # replacements
        if len(self.ready) < cfg.prompts_per_step:
            return
        batch = [self.ready.popleft() for _ in range(cfg.prompts_per_step)]
        for group in batch:
            del self.live_groups[group]
        res, tokens = self.result, 0
        for traj in (t for g in batch for t in g.trajectories):
            res.staleness_trajectories[self.version - min(traj.versions)] += 1
            for version, n in traj.versions.items():
                res.staleness_tokens[self.version - version] += n
            res.trained_trajectories += 1
            res.trained_tokens += traj.generated
            tokens += traj.generated + cfg.prompt_tokens
        res.trainer_wait_s += self.now - self.trainer_free_since
        train_s = cfg.train_s(tokens)
        res.train_s += train_s
        self.trainer_busy = True
        self._at(self.now + train_s, "train_done")

    def _on_train_done(self, _: Any) -> None:
        """Push: every engine pauses (a running step is preempted); restart aborts."""
        for engine in self.engines:
            self._advance(engine, exact=False)
            for traj in engine.running:
                self._credit(traj)
            engine.paused, engine.scheduled = True, None
            engine.generation += 1
        if self.cfg.partial_rollout is PartialRollout.RESTART:
            self._restart_in_flight()
        self.result.push_s += self.cfg.push_s
        pause = self.cfg.push_s if self.cfg.engine_pause_s is None else self.cfg.engine_pause_s
        self._at(self.now + pause, "engines_resume")
        self._at(self.now + self.cfg.push_s, "push_done")

    def _restart_in_flight(self) -> None:
        """Every trajectory with tokens is aborted and queued again from its first turn, ahead
        of the trajectories that were waiting (running ones without tokens are queued too)."""
        aborted = {t: None for t in self.unfinished if t.turn or t.generated}
        for traj in aborted:
            self.result.restarted_trajectories += 1
            self.result.wasted_tokens += traj.generated
            traj.turn, traj.generated, traj.versions = 0, 0, Counter()
            traj.attempt += 1
        for engine in self.engines:
            first = sorted(
                {*engine.running, *(t for t in aborted if t.engine is engine)},
                key=lambda t: t.index,
            )
            waiting = [t for t in engine.queue if t not in aborted and t not in engine.running]
            engine.queue = deque(first + waiting)
            engine.running.clear()
            engine.ends.clear()

    def _on_push_done(self, _: Any) -> None:
        self.version += 1
        self.result.step_end_s.append(self.now)
        self.result.step_wait_s.append(self.result.trainer_wait_s)
        self.trainer_busy, self.trainer_free_since = False, self.now
        if len(self.result.step_end_s) == self.cfg.num_steps:
            return  # the run ends here
        self._start_groups()
        self._try_train()

    def _on_engines_resume(self, _: Any) -> None:
        """The engines end their pause (at the push's end unless ``engine_pause_s`` says other)."""
        if len(self.result.step_end_s) == self.cfg.num_steps:
            return
        for engine in self.engines:
            engine.paused, engine.last = False, self.now
            self._fill(engine)
            self._schedule(engine)

    # ------------------------------------------------------------------ engines

    def _arrive(self, traj: _Trajectory) -> None:
        """``traj`` wants its next turn on its engine: it joins at the next step boundary."""
        engine = traj.engine
        engine.queue.append(traj)
        if engine.paused or len(engine.running) >= self.cfg.slots_per_engine:
            return
        self._advance(engine, exact=False)
        boundary = engine.last
        if engine.running and engine.last < self.now:
            boundary += self.cfg.step_s(len(engine.running))
        self._schedule_at(engine, boundary)

    def _on_env(self, payload: tuple[_Trajectory, int]) -> None:
        traj, attempt = payload
        if attempt == traj.attempt:
            self._arrive(traj)

    def _on_engine(self, payload: tuple[_Engine, int]) -> None:
        engine, generation = payload
        if generation != engine.generation:
            return
        engine.scheduled = None
        self._advance(engine, exact=True)
        while engine.ends and engine.ends[0][0] <= engine.steps:
            _, _, traj = heapq.heappop(engine.ends)
            del engine.running[traj]
            self._credit(traj)
            traj.turn += 1
            if traj.turn == len(traj.turns):
                self._finish(traj)
            elif self.cfg.env_step_s > 0:
                self._at(self.now + self.cfg.env_step_s, "env", (traj, traj.attempt))
            else:
                engine.queue.append(traj)
        self._fill(engine)
        self._schedule(engine)

    def _advance(self, engine: _Engine, *, exact: bool) -> None:
        """Count the decode steps ``engine`` finished by now (``exact``: now is a boundary)."""
        if engine.paused:
            return
        if not engine.running:
            engine.last = self.now
            return
        step = self.cfg.step_s(len(engine.running))
        x = (self.now - engine.last) / step
        n = max(0, round(x) if exact else math.floor(x + 1e-9))  # < 0: inside a prefill
        engine.steps += n
        engine.last += n * step
        engine.busy_s += n * step

    def _credit(self, traj: _Trajectory) -> None:
        n = traj.engine.steps - traj.credited_step
        if n:
            traj.versions[self.version] += n
            traj.generated += n
            self.result.generated_tokens += n
        traj.credited_step = traj.engine.steps

    def _fill(self, engine: _Engine) -> None:
        """Queued trajectories take free slots (at a step boundary: now)."""
        if engine.paused:
            return
        if not engine.running:
            engine.last = self.now
        prefill = self.cfg.prefill_s is not None
        joined = False
        while engine.queue and len(engine.running) < self.cfg.slots_per_engine:
            traj = engine.queue.popleft()
            # With a prefill its token is the turn's first: credited with the next decode steps.
            traj.credited_step = engine.steps - prefill
            end = engine.steps + traj.turns[traj.turn] - prefill
            engine.running[traj] = None
            heapq.heappush(engine.ends, (end, traj.index, traj))
            joined = True
        if joined and prefill:
            engine.last += self.cfg.prefill_s  # one prefill forward of every joiner
            engine.busy_s += self.cfg.prefill_s

    def _schedule(self, engine: _Engine) -> None:
        """The next event of a running engine: its first turn end."""
        if engine.paused or not engine.running:
            return
        steps_left = engine.ends[0][0] - engine.steps
        engine.scheduled = None
        self._schedule_at(engine, engine.last + steps_left * self.cfg.step_s(len(engine.running)))

    def _schedule_at(self, engine: _Engine, time: float) -> None:
        if engine.scheduled is not None and engine.scheduled <= time:
            return
        engine.generation += 1
        engine.scheduled = time
        self._at(time, "engine", (engine, engine.generation))


def _oldest(group: _Group) -> int:
    """The weight version of the group's oldest token."""
    return min(min(t.versions) for t in group.trajectories)
