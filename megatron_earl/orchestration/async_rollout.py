"""Trajectory-level asynchronous rollout (``rollout.mode: async``): each trainer rank keeps
generating groups on the SGLang-protocol engines in a background thread while the trainer
trains; the trainer takes a step's groups as they finish and never waits for the slowest one.

    producer = AsyncProducer(plan, agent_loop_factory, ...)
    producer.start()
    producer.begin_update();  <push weights, every rank>;  producer.end_update(version, step)
    taken = producer.take(step)            # blocks until this rank's quota of groups is ready
    producer.stop()

Groups. Global group g is prompt ``g`` (task seed g, as the synchronous loop's step
``g // prompts_per_step`` would use it), tagged ``s<step>-<i>`` with i = g mod prompts_per_step
and sampled with the same per-step sampling seed: with ``max_staleness: 0`` every group is the
synchronous loop's. Group g belongs to rank ``i % world`` (the synchronous split), so a rank's
quota per step is fixed and every rank knows every other's.

Admission (AReaL's staleness rule, in RL steps): when the engines serve the weights of step s,
a rank may have started at most ``quota x (s + max_staleness + 1)`` groups, discarded ones not
counted (each discard lets a new prompt start), and at most its share of
``rollout.max_buffered_groups`` started but not consumed. With staleness 0 the groups of step s
start only once step s's weights are on the engines, and the step trains on all of them: the
synchronous loop's trajectories.

Versions. Every model turn records the weight version of the engines when its request was sent
(the smaller of that and the version the engine reports): a request that straddles a weight
update (``partial_rollout: continue``) is counted under its older version, so staleness is never
under-reported (``straddled_turns`` counts them). At consumption a group whose oldest turn is
more than ``max_staleness`` steps behind the step being trained is discarded and counted, never
trained on.

Partial rollouts: ``continue`` leaves in-flight requests to the engines (the push pauses them in
place or retracts them, then they continue under the new weights); ``restart`` cancels every
unfinished trajectory before the push (their HTTP requests are dropped; the server aborts them)
and runs it again from its start under the new weights; the tokens it had received are counted
as wasted (a lower bound: tokens of the dropped request are not known).

Dynamic sampling (``rollout.dynamic_sampling``): a finished group whose rewards are all equal
(``orchestration.dynamic_sampling.judge_group``) is dropped instead of buffered and counted like a
discarded one: it frees its admission slot, so the next prompt starts in its place. A rank drops
at most its share of ``max_extra_prompts`` per RL step admitted (``GroupPlan.drop_budget``); past
it uninformative groups are buffered (counted as filler), so a policy whose every group is equal
still trains, never loops.

Accounting: ``produced`` (finished groups) = ``consumed`` + ``discarded`` + ``dropped`` +
buffered at any time; every started group is in flight, buffered, consumed, discarded or dropped
(``check_accounting``).

Threads: the producer's event loop runs in its own thread and only speaks HTTP; the trainer's
thread calls ``take``/``begin_update``/``end_update`` (thread-safe) and does every collective.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from megatron_earl.envs.base import ENVS
from megatron_earl.orchestration.dynamic_sampling import GroupVerdict, judge_group
from megatron_earl.rollout.agent.loop import AgentLoop
from megatron_earl.rollout.agent.trajectory import Trajectory
from megatron_earl.rollout.engine import GenerateRequest, GenerateResult
from megatron_earl.rollout.repack import Placement


@dataclass(frozen=True)
class GroupPlan:
    """Which groups this rank generates, and the admission numbers (pure)."""

    prompts_per_step: int
    rank: int
    world: int
    max_staleness: int = 0
    max_buffered_groups: int | None = None
    seed: int = 0
    """The run seed (per-step sampling seed ``seed * 1_000_003 + step``, as the sync loop)."""
    first_step: int = 0
    """The RL step the producer starts at (a resumed run's step): its first group is that
    step's, and the groups of earlier steps count as started (admission)."""
    max_dropped_per_step: int = 0
    """Dynamic sampling: uninformative groups the ranks may drop per RL step, over all ranks
    (``rollout.dynamic_sampling.max_extra_prompts``); 0 without it."""

    def __post_init__(self) -> None:
        if self.quota < 1:
            raise ValueError(
                f"rank {self.rank} of {self.world} gets no group of a step of "
                f"{self.prompts_per_step} prompts; use batch.prompts_per_step >= world size"
            )

    @property
    def first_group(self) -> int:
        """This rank's index j of the first group it generates (``group(j)``)."""
        return self.first_step * self.quota

    @property
    def quota(self) -> int:
        """Groups of one step this rank generates: i in [0, n) with i % world == rank."""
        return len(range(self.rank, self.prompts_per_step, self.world))

    def group(self, j: int) -> int:
        """Global index of this rank's j-th group."""
        step, k = divmod(j, self.quota)
        return step * self.prompts_per_step + self.rank + k * self.world

    def step_of(self, g: int) -> int:
        return g // self.prompts_per_step

    def group_id(self, g: int) -> str:
        return f"s{g // self.prompts_per_step}-{g % self.prompts_per_step}"

    def sampling_seed(self, g: int) -> int:
        return self.seed * 1_000_003 + self.step_of(g)

    def limit(self, pushed_step: int) -> int:
        """Groups (not counting discarded ones) this rank may have started while the engines
        serve step ``pushed_step``'s weights."""
        return self.quota * (pushed_step + self.max_staleness + 1)

    def drop_budget(self, pushed_step: int) -> int:
        """Uninformative groups this rank may have dropped while the engines serve step
        ``pushed_step``'s weights: its share of ``max_dropped_per_step`` for every step admitted
        so far."""
        share = -(-self.max_dropped_per_step * self.quota // self.prompts_per_step)
        return share * (pushed_step - self.first_step + self.max_staleness + 1)

    def buffer_cap(self) -> int | None:
        """This rank's share of ``max_buffered_groups`` (groups started, not consumed)."""
        if self.max_buffered_groups is None:
            return None
        return max(self.quota, -(-self.max_buffered_groups * self.quota // self.prompts_per_step))


@dataclass
class FinishedGroup:
    index: int
    """Global group index g."""
    trajectories: list[Trajectory]
    finished_s: float = 0.0


@dataclass
class Taken:
    """What ``take`` returns for one step."""

    groups: list[FinishedGroup]
    """This rank's quota of groups, by global index."""
    discarded: list[FinishedGroup] = field(default_factory=list)
    """Groups dropped as too stale while waiting (counted, never trained on)."""
    wait_s: float = 0.0
    """Seconds the trainer waited for them."""
    lags: list[int] = field(default_factory=list)
    """Per taken trajectory: RL steps between its oldest turn's weights and this step."""
    token_lags: Counter = field(default_factory=Counter)
    """Generated tokens per lag (steps)."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


class _VersionTagger:
    """The engine the agent loop sees: the pool, with each result's version set to the one the
    engines served when the request was sent (or the engine's, if smaller), and tokens counted
    per trajectory (for the wasted-token count of restarts)."""

    def __init__(self, inner, producer: AsyncProducer) -> None:
        self.inner = inner
        self.producer = producer

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        sent = self.producer.version
        result = await self.inner.generate(request)
        if result.weight_version != sent:
            self.producer.straddled_turns += 1
        self.producer.tokens_of[request.session or request.rid] += len(result.output_ids)
        if result.weight_version <= sent:
            return result
        return replace(result, weight_version=sent)

    async def abort(self, rid: str) -> None:
        await self.inner.abort(rid)

    async def health(self) -> bool:
        return await self.inner.health()

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version


class AsyncProducer:
    """This rank's background generation (module docstring)."""

    def __init__(
        self,
        plan: GroupPlan,
        env_spec: dict,
        agent_loop: Callable[[object], AgentLoop],
        make_engine: Callable[[], object],
        close_engine: Callable[[object], object],
        *,
        group_size: int,
        partial_rollout: str = "continue",
        placement: Callable[[object], Placement] | None = None,
        judge: tuple[str, float] | None = None,
    ) -> None:
        self.plan = plan
        self.env_spec = env_spec
        self._agent_loop = agent_loop
        self._make_engine = make_engine
        self._close_engine = close_engine
        self.group_size = group_size
        self.partial_rollout = partial_rollout
        self.judge = judge
        """Dynamic sampling: (metric, tolerance) of ``judge_group``; None keeps every group."""
        self.version = 0
        """Weight version the engines serve (set by ``end_update``)."""
        self.pushed_step = -1
        """RL step whose weights the engines serve (-1: none yet; nothing starts)."""
        self.version_step: dict[int, int] = {}
        """Weight version -> the RL step it was pushed for."""
        self.started = 0
        self.produced = 0
        self.consumed = 0
        self.discarded = 0
        self.dropped: Counter = Counter()
        """Dynamic sampling: groups dropped by verdict (never buffered)."""
        self.dropped_trajectories = 0
        self.dropped_generated_tokens = 0
        self.filler = 0
        """Dynamic sampling: uninformative groups buffered because the drop budget was spent."""
        self.restarts = 0
        self.wasted_tokens = 0
        self.straddled_turns = 0
        self.mixed_version_trajectories = 0
        self.tokens_of: Counter = Counter()
        self._ready: list[FinishedGroup] = []
        self._cond = threading.Condition()
        self._updating = False
        self._stopping = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._attempts: set[asyncio.Task] = set()
        self._groups: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self.engine: object | None = None
        """The engine the producer drives (the pool; its failover counters are reported)."""
        self._make_placement = placement
        self.placement: Placement | None = None
        """``rollout.repack``: where each trajectory runs (``rollout.repack``)."""

    # ------------------------------------------------------------------ trainer thread

    def start(self) -> None:
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name="async-rollout", daemon=True
        )
        self._thread.start()
        started.wait()

    def begin_update(self) -> None:
        """Before a weight push: hold new starts; ``restart``: cancel unfinished trajectories
        (returns once they are cancelled)."""
        self._call(self._begin_update())

    def end_update(self, version: int, step: int) -> None:
        """The engines serve ``version``, pushed for RL step ``step``: admit and resume."""
        self._call(self._end_update(version, step))

    def take(self, step: int, timeout_s: float | None = None) -> Taken:
        """Block until this rank holds ``plan.quota`` groups no more than ``max_staleness``
        steps behind ``step``; staler ones are discarded (counted). Raises what the producer
        raised, or ``TimeoutError``."""
        start = time.perf_counter()
        quota, k = self.plan.quota, self.plan.max_staleness
        taken: list[FinishedGroup] = []
        dropped: list[FinishedGroup] = []
        with self._cond:
            while len(taken) < quota:
                while not self._ready and self._error is None:
                    remaining = (
                        None if timeout_s is None else timeout_s - (time.perf_counter() - start)
                    )
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"async rollout: {len(taken)} of {quota} groups ready for step "
                            f"{step} after {timeout_s:g} s ({self.summary()})"
                        )
                    self._cond.wait(remaining)
                if self._error is not None:
                    raise RuntimeError("the async rollout producer failed") from self._error
                group = self._ready.pop(0)
                if step - self._oldest_step(group) > k:
                    dropped.append(group)
                    self.discarded += 1
                    self._wake_producer()  # a discard lets a new prompt start: now, not after
                else:
                    taken.append(group)
                    self.consumed += 1
        taken.sort(key=lambda g: g.index)
        out = Taken(taken, dropped, time.perf_counter() - start)
        for group in taken:
            for traj in group.trajectories:
                out.lags.append(step - self._oldest_step_of(traj))
                for turn in traj.turns:
                    lag = step - self.version_step.get(turn.weight_version, step)
                    out.token_lags[lag] += turn.end - turn.start
        return out

    def stop(self) -> None:
        """Cancel everything in flight and join the thread. Idempotent."""
        if self._thread is None:
            return
        self._call(self._stop())
        self._thread.join(timeout=60)
        self._thread = None

    def buffered(self) -> int:
        with self._cond:
            return len(self._ready)

    def check_accounting(self) -> None:
        """Every started group is in flight, buffered, consumed or discarded; none twice."""
        with self._cond:
            buffered = len(self._ready)
        dropped = self.dropped.total()
        if self.produced != self.consumed + self.discarded + dropped + buffered:
            raise AssertionError(
                f"async rollout accounting: produced {self.produced} != consumed "
                f"{self.consumed} + discarded {self.discarded} + dropped {dropped} + buffered "
                f"{buffered}"
            )
        if self.produced > self.started:
            raise AssertionError(f"produced {self.produced} > started {self.started}")

    def summary(self) -> str:
        return (
            f"started {self.started}, produced {self.produced}, consumed {self.consumed}, "
            f"discarded {self.discarded}, dropped {self.dropped.total()}, buffered "
            f"{self.buffered()}, engines at step "
            f"{self.pushed_step}"
        )

    def _oldest_step(self, group: FinishedGroup) -> int:
        return min((self._oldest_step_of(t) for t in group.trajectories), default=0)

    def _oldest_step_of(self, traj: Trajectory) -> int:
        versions = traj.weight_versions
        if not versions:  # no model turn (failed before generating): as fresh as can be
            return self.pushed_step
        return min(self.version_step.get(v, -1) for v in versions)

    def _wake_producer(self) -> None:
        """Make the producer's loop check admission again (thread-safe; does not wait, so it
        may be called holding ``_cond``, which the loop's thread may be waiting for)."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _call(self, coro) -> None:
        if self._loop is None:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=300)

    # ------------------------------------------------------------------ producer thread

    def _thread_main(self, started: threading.Event) -> None:
        try:
            asyncio.run(self._main(started))
        except BaseException as err:  # surfaced to the trainer by take()
            with self._cond:
                self._error = err
                self._cond.notify_all()
            started.set()

    async def _main(self, started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        engine = self._make_engine()
        self.engine = engine
        if self._make_placement is not None:
            self.placement = self._make_placement(engine)
            self.placement.start()
        self._agent = self._agent_loop(_VersionTagger(engine, self))
        self._factory = ENVS.factory(self.env_spec)
        started.set()
        try:
            j = self.plan.first_group
            while not self._stopping:
                if self._may_start():
                    g = self.plan.group(j)
                    j += 1
                    self.started += 1
                    task = asyncio.create_task(self._run_group(g))
                    self._groups.add(task)
                    task.add_done_callback(self._group_done)
                    continue
                self._wake.clear()
                await self._wake.wait()
        finally:
            for task in [*self._groups]:
                task.cancel()
            await asyncio.gather(*self._groups, return_exceptions=True)
            if self.placement is not None:
                await self.placement.close()
            await self._close_engine(engine)

    def _may_start(self) -> bool:
        if self._updating or self.pushed_step < 0:
            return False
        freed = self.discarded + self.dropped.total()
        live = self.plan.first_group + self.started - freed
        if live >= self.plan.limit(self.pushed_step):
            return False
        cap = self.plan.buffer_cap()
        return cap is None or self.started - self.consumed - freed < cap

    def _group_done(self, task: asyncio.Task) -> None:
        self._groups.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None and self._error is None:
            with self._cond:
                self._error = task.exception()
                self._cond.notify_all()

    async def _run_group(self, g: int) -> None:
        gid, seed = self.plan.group_id(g), self.plan.sampling_seed(g)
        trajectories = await asyncio.gather(
            *(self._run_one(g, gid, i, seed) for i in range(self.group_size))
        )
        verdict = (
            GroupVerdict.INFORMATIVE
            if self.judge is None
            else judge_group(trajectories, *self.judge)
        )
        with self._cond:
            self.produced += 1
            if verdict != GroupVerdict.INFORMATIVE:
                if self.dropped.total() < self.plan.drop_budget(self.pushed_step):
                    self.dropped[verdict] += 1
                    self.dropped_trajectories += len(trajectories)
                    self.dropped_generated_tokens += sum(sum(t.loss_mask) for t in trajectories)
                    self._wake.set()  # its slot is free: the next prompt starts now
                    return
                self.filler += 1
            self._ready.append(FinishedGroup(g, list(trajectories), time.monotonic()))
            self._cond.notify_all()

    async def _run_one(self, g: int, gid: str, i: int, seed: int) -> Trajectory:
        uid = f"{gid}/{i}"
        while True:
            await self._resumed.wait()
            if self.placement is not None:
                await self.placement.begin(uid)
            attempt = asyncio.create_task(
                self._agent.run_trajectory(self._factory, g, gid, i, sampling_seed=seed)
            )
            self._attempts.add(attempt)
            try:
                trajectory = await attempt
                if len(set(trajectory.weight_versions)) > 1:
                    self.mixed_version_trajectories += 1
                return trajectory
            except asyncio.CancelledError:
                if self._stopping or not attempt.cancelled():
                    raise
                self.restarts += 1
                self.wasted_tokens += self.tokens_of.pop(uid, 0)
            finally:
                if self.placement is not None:
                    self.placement.end(uid)
                self._attempts.discard(attempt)
                if attempt.done() and not attempt.cancelled():
                    self.tokens_of.pop(uid, None)

    async def _begin_update(self) -> None:
        self._updating = True
        if self.partial_rollout == "restart":
            self._resumed.clear()
            attempts = [a for a in self._attempts if not a.done()]
            for attempt in attempts:
                attempt.cancel()
            await asyncio.gather(*attempts, return_exceptions=True)

    async def _end_update(self, version: int, step: int) -> None:
        self.version, self.pushed_step = version, step
        self.version_step[version] = step
        if self.placement is not None:
            self.placement.set_newest(version)
        self._updating = False
        self._resumed.set()
        self._wake.set()

    async def _stop(self) -> None:
        self._stopping = True
        self._resumed.set()
        self._wake.set()


def async_metrics(producer: AsyncProducer, taken: Taken, max_staleness: int) -> dict[str, float]:
    """This rank's counters for the step (summed over ranks by the loop: the same keys on every
    rank): cumulative produced/consumed/discarded groups, buffered and in-flight groups, the
    step's discards, restarts and wasted tokens, straddled turns, the engine pool's failovers
    and requests moved off a stalled engine (cumulative), ``rollout.repack``'s counters
    (``Placement.stats``, cumulative), and trajectories and generated tokens per lag
    0..max_staleness; with dynamic sampling, the groups dropped (by verdict), buffered as
    filler, and the trajectories and generated tokens dropped (cumulative)."""
    out = {
        "async_started_groups": float(producer.started),
        "async_produced_groups": float(producer.produced),
        "async_consumed_groups": float(producer.consumed),
        "async_discarded_groups": float(producer.discarded),
        "async_step_discarded_groups": float(len(taken.discarded)),
        "async_buffered_groups": float(producer.buffered()),
        "async_in_flight_groups": float(producer.started - producer.produced),
        "async_restarts": float(producer.restarts),
        "async_wasted_tokens": float(producer.wasted_tokens),
        "async_straddled_turns": float(producer.straddled_turns),
        "async_mixed_version_trajectories": float(producer.mixed_version_trajectories),
        "async_engine_failovers": float(getattr(producer.engine, "failovers", 0)),
        "async_moved_from_stalled": float(getattr(producer.engine, "moved_from_stalled", 0)),
    }
    if producer.judge is not None:
        out["async_dropped_groups"] = float(producer.dropped.total())
        for verdict in (GroupVerdict.ALL_CORRECT, GroupVerdict.ALL_WRONG, GroupVerdict.OTHER):
            out[f"async_dropped_{verdict}_groups"] = float(producer.dropped[verdict])
        out["async_filler_groups"] = float(producer.filler)
        out["async_dropped_trajectories"] = float(producer.dropped_trajectories)
        out["async_dropped_generated_tokens"] = float(producer.dropped_generated_tokens)
    if producer.placement is not None:
        out.update(producer.placement.stats())
    lags = Counter(taken.lags)
    for lag in range(max_staleness + 1):
        out[f"staleness_traj_lag{lag}"] = float(lags.get(lag, 0))
        out[f"staleness_token_lag{lag}"] = float(taken.token_lags.get(lag, 0))
    return out


def group_ids(groups: Sequence[FinishedGroup], plan: GroupPlan) -> dict[str, int]:
    """Group id -> global index, unique across the steps a batch mixes."""
    return {plan.group_id(g.index): g.index for g in groups}
