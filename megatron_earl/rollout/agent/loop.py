"""The agent loop: multi-turn rollouts of environments driven by any ``Engine``, token-in /
token-out, every trajectory an independent asyncio task.

    loop = AgentLoop(engine, DemoTokenizer(), AgentLoopConfig(group_size=4))
    batch = await loop.run_batch([RolloutTask(ENVS.factory("arithmetic"), seed=s) for s in seeds])
    batch.trajectories, batch.metrics.to_dict()

One trajectory:  reset -> render prompt -> [generate -> step -> append observation]* -> rewards.
The sampled ids are kept exactly (with their log-probs and the policy version of the turn);
observations are tokenized once (``end_of_turn_suffix + render_turn + generation_prompt``) and
appended with loss mask 0. Limits end a trajectory with a recorded ``EndReason``: ``max_turns``,
``sampling.max_new_tokens`` per turn (TURN_LENGTH), ``max_context_tokens`` (CONTEXT_LIMIT: a
turn is given only the budget left; an observation that would not fit leaves the context as it
is). The config's ``SamplingParams`` goes whole into every request (``AgentLoopConfig.sampling``):
a turn that ends at a ``sampling.stop`` string or ``sampling.stop_token_ids`` id is complete like
one that ends at the tokenizer's stop ids (the environment gets it, a stop string kept in its
text), and the next observation follows it as it is.

Asynchrony: each trajectory is its own task; a per-engine semaphore bounds the generate calls
in flight (``max_concurrency_per_engine``) and is held only while generating, so a slow
environment or tool never holds an engine slot nor blocks another trajectory's turn.
Synchronous environment methods and reward functions (plain ``def``) run on a bounded pool of
worker threads (``user_threads``), so one that blocks never stalls the other trajectories; an
``async def`` method must not block the event loop itself (no ``time.sleep``, no blocking I/O).
Failures are contained per trajectory: an environment that raises (``SystemExit``,
``KeyboardInterrupt`` and an ``asyncio.CancelledError`` of its own included), runs past
``env_timeout_s`` (even one that swallows the cancellation: ``bounded``) or returns garbage
(``check_reset_result``, ``check_step_result``: the error names the environment, the method and
the value), an engine error or abort, a reward that fails or runs past ``reward_timeout_s`` ->
that trajectory is FAILED with its reason; the batch completes and ``RolloutMetrics.failures``
counts them. A cancellation of the batch by its caller still cancels it.
"""

from __future__ import annotations

import asyncio
import itertools
import reprlib
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from megatron_earl.compat.user_threads import call_user
from megatron_earl.envs.base import (
    ENVS,
    Action,
    Environment,
    check_reset_result,
    check_step_result,
)
from megatron_earl.models.routing import RoutingError, check_routes
from megatron_earl.rewards.base import RewardInput, WeightedReward, format_reward
from megatron_earl.rollout.agent.metrics import RolloutMetrics
from megatron_earl.rollout.agent.trajectory import EndReason, Trajectory, TurnRecord
from megatron_earl.rollout.engine import (
    Engine,
    FinishType,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from megatron_earl.tokenizer.base import ChatTokenizer

USER_ERRORS = (Exception, SystemExit, KeyboardInterrupt)
"""What user code (environments, tools, reward functions) may raise that fails only its
trajectory: ``SystemExit`` / ``KeyboardInterrupt`` from an env do not end the process. A
cancellation of the caller is never swallowed; an ``asyncio.CancelledError`` the user code raises
itself reaches the caller as ``UserCodeExit`` (``bounded``)."""


async def bounded(coro, timeout_s: float):
    """Await ``coro`` for at most ``timeout_s``; on timeout cancel it and raise
    ``asyncio.TimeoutError`` at once, without waiting for it to finish (``asyncio.wait_for``
    waits for the cancelled call, so user code that swallows the cancellation would hang the
    caller; such a call is left to finish in the background, its outcome discarded). A
    cancellation of the caller cancels the call too; a call that ends cancelled otherwise
    cancelled itself (raised ``asyncio.CancelledError``) and raises ``UserCodeExit``."""
    task = asyncio.ensure_future(_converted(coro))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_discard_outcome)
        asyncio.get_running_loop().call_later(ABANDON_GRACE_S, _close_if_deaf, task)
        raise asyncio.TimeoutError
    try:
        return task.result()
    except asyncio.CancelledError as e:
        # The call cancelled itself: it is cancelled from here only on a timeout or a
        # cancellation of the caller (both above), and the wait returned, so the caller is not.
        raise UserCodeExit(f"CancelledError({e})") from e


ABANDON_GRACE_S = 1.0
"""Seconds a timed-out user call has to honour its cancellation before its coroutine is closed."""


def _close_if_deaf(task: asyncio.Task) -> None:
    """Close the coroutine of a timed-out call that swallowed its cancellation: GeneratorExit is
    thrown in at its await point, so the task ends (with an error) instead of keeping the event
    loop's shutdown waiting for it forever. A coroutine that swallows GeneratorExit too cannot be
    stopped from Python; that one is left (and logged by asyncio)."""
    if task.done():
        return
    try:
        task.get_coro().close()
    except RuntimeError:  # it ignored GeneratorExit as well
        return
    task.cancel()  # wakes the task from its pending await: the closed coroutine ends it


class UserCodeExit(RuntimeError):
    """``SystemExit`` / ``KeyboardInterrupt`` raised by user code, turned into an ordinary error
    inside its task (an asyncio task re-raises those two into the event loop, which would end
    the whole rollout), or an ``asyncio.CancelledError`` the user code raised itself (``bounded``;
    it would otherwise cancel the caller's task)."""


async def _converted(coro):
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as e:
        raise UserCodeExit(f"{type(e).__name__}({e})") from e


def _discard_outcome(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned call's error is not logged as unhandled


@dataclass(frozen=True)
class AgentLoopConfig:
    """Limits and sampling of the agent loop."""

    max_turns: int = 8
    """Model turns per trajectory at most."""
    max_context_tokens: int = 4096
    """Prompt + response tokens of a trajectory at most."""
    group_size: int = 1
    """Samples per prompt (a group shares the task seed)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling of every model turn, sent whole with each request, except that
    ``max_new_tokens`` is the per-turn limit (a turn is given at most the context budget left),
    the tokenizer's stop ids are added to ``stop_token_ids``, and ``seed`` is one root of the
    requests' seeds (``sampling_seed``)."""
    sampling_seed: int | None = None
    """The rollout's seed (the trainer's changes every step). When it or ``sampling.seed`` is
    set, every request gets a distinct deterministic seed derived from both, the trajectory and
    the turn (one seed for every request would sample the same tokens for a whole group);
    neither: the engine's own random stream."""
    env_timeout_s: float = 60.0
    """Limit on one ``reset``, ``step`` or ``close`` call."""
    reward_timeout_s: float = 60.0
    """Limit on one reward function call."""
    max_concurrency_per_engine: int = 64
    """Generate calls in flight per engine."""
    format_reward_weight: float = 0.0
    """Weight of the format reward in the total (0 = not computed)."""
    routed_experts: tuple[int, int, int] | None = None
    """(MoE layers, topk, experts): ask every turn for the experts its positions were routed
    to, from the first position the trajectory holds none for (``routed_experts_start_len``),
    check them (a turn whose routes do not fit the model fails its trajectory) and keep them
    with the tokens (``Trajectory.routed_experts``: routing replay). None: not asked."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_context_tokens", "group_size", "max_concurrency_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentLoopConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.sampling.max_new_tokens < 1:
            raise ValueError(
                "AgentLoopConfig.sampling.max_new_tokens (per turn) must be >= 1, got "
                f"{self.sampling.max_new_tokens}"
            )
        for name in ("env_timeout_s", "reward_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"AgentLoopConfig.{name} must be > 0 and finite, got {value}")


EnvFactory = Callable[[], Environment]


@dataclass(frozen=True)
class RolloutTask:
    """One prompt: an environment factory (or spec) and its task seed."""

    env: EnvFactory | str | dict
    """Zero-argument factory, or a spec for ``ENVS`` (name, dotted path, {name, kwargs})."""
    seed: int
    """Task seed."""
    group_id: str | None = None
    """Group id; a fresh one when None."""


@dataclass
class RolloutBatch:
    trajectories: list[Trajectory] = field(default_factory=list)
    """Grouped: the samples of a task are contiguous, in task order."""
    metrics: RolloutMetrics = field(default_factory=RolloutMetrics)


class _EnvFailure(Exception):
    def __init__(self, reason: EndReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class AgentLoop:
    """Drives trajectories over one or more engines (see the module docstring)."""

    def __init__(
        self,
        engines: Engine | Sequence[Engine],
        tokenizer: ChatTokenizer,
        config: AgentLoopConfig | None = None,
        reward_fns: Sequence[WeightedReward] = (),
    ) -> None:
        self.engines = list(engines) if isinstance(engines, Sequence) else [engines]
        if not self.engines:
            raise ValueError("AgentLoop needs at least one engine")
        self.tokenizer = tokenizer
        self.config = config or AgentLoopConfig()
        self.reward_fns = list(reward_fns)
        self._slots = [
            asyncio.Semaphore(self.config.max_concurrency_per_engine) for _ in self.engines
        ]
        self._next_engine = itertools.count()
        self._suffix = tokenizer.end_of_turn_suffix()
        self._gen_prompt = tokenizer.generation_prompt()
        stop_ids = (*tokenizer.stop_ids, *self.config.sampling.stop_token_ids)
        self._sampling = replace(
            self.config.sampling, stop_token_ids=tuple(dict.fromkeys(stop_ids))
        )
        """Every request's sampling, but for its ``max_new_tokens`` and ``seed``."""

    # -- batch ---------------------------------------------------------------------------
    async def run_batch(self, tasks: Sequence[RolloutTask]) -> RolloutBatch:
        """Run ``group_size`` trajectories per task concurrently; never raises for a failing
        environment, engine or reward (those trajectories come back FAILED)."""
        start = time.monotonic()
        groups = await asyncio.gather(*(self.run_group(t) for t in tasks))
        trajs = [t for g in groups for t in g]
        return RolloutBatch(
            trajs, RolloutMetrics.from_trajectories(trajs, time.monotonic() - start)
        )

    async def run_group(self, task: RolloutTask) -> list[Trajectory]:
        factory = task.env if callable(task.env) else ENVS.factory(task.env)
        group_id = task.group_id or uuid.uuid4().hex[:12]
        return list(
            await asyncio.gather(
                *(
                    self.run_trajectory(factory, task.seed, group_id, i)
                    for i in range(self.config.group_size)
                )
            )
        )

    # -- one trajectory ------------------------------------------------------------------
    async def run_trajectory(
        self,
        factory: EnvFactory,
        seed: int,
        group_id: str,
        sample_index: int = 0,
        sampling_seed: int | None = None,
    ) -> Trajectory:
        """One episode. ``sampling_seed`` replaces the config's for this trajectory's requests
        (the asynchronous producer runs groups of several steps on one loop)."""
        traj = Trajectory(group_id, sample_index, seed)
        engine_idx = next(self._next_engine) % len(self.engines)
        start = time.monotonic()
        env: Environment | None = None
        turn_texts: list[str] = []
        stopped: list[bool] = []
        try:
            try:
                made = factory()
            except (*USER_ERRORS, asyncio.CancelledError) as e:  # a plain call: its
                # CancelledError is the environment's own (this task's arrives at an await)
                raise _EnvFailure(
                    EndReason.ENV_ERROR, f"creating the environment raised {type(e).__name__}: {e}"
                ) from e
            if not isinstance(made, Environment):
                raise _EnvFailure(
                    EndReason.ENV_GARBAGE,
                    f"the environment factory returned {reprlib.repr(made)}, expected an "
                    "Environment",
                )
            env = made
            reset = await self._call_env(env, "reset", seed)
            garbage = check_reset_result(reset, self.tokenizer.vocab_size)
            if garbage is not None:
                raise _EnvFailure(
                    EndReason.ENV_GARBAGE, f"{type(env).__name__}.reset returned {garbage}"
                )
            traj.info.update(reset.info)
            traj.prompt_ids = self._render_prompt(env, reset.prompt)
            await self._episode(env, traj, engine_idx, turn_texts, stopped, sampling_seed)
            if traj.ok:
                await self._score(traj, turn_texts, stopped)
        except _EnvFailure as e:
            traj.fail(e.reason, str(e))
        finally:
            if env is not None:
                try:
                    await bounded(call_user(env.close), self.config.env_timeout_s)
                except USER_ERRORS as e:  # a failing close does not change the episode
                    traj.info["close_error"] = f"{type(e).__name__}: {e}"
            traj.wall_s = time.monotonic() - start
        traj.check()
        return traj

    def _render_prompt(self, env: Environment, prompt: list) -> list[int]:
        """The ids of a prompt ``check_reset_result`` accepted: chat messages rendered, or the
        token ids as they are."""
        if all(isinstance(m, dict) for m in prompt):
            try:
                return self.tokenizer.render_messages(prompt, add_generation_prompt=True)
            except Exception as e:  # ValueError, or the HF template's own errors
                raise _EnvFailure(
                    EndReason.ENV_GARBAGE,
                    f"{type(env).__name__}.reset returned bad prompt messages: {e}",
                ) from e
        return list(prompt)

    async def _call_env(self, env: Environment, name: str, *args):
        """``env.<name>(*args)`` (a synchronous method on a worker thread: ``call_user``) under
        ``env_timeout_s``; any failure is an ``_EnvFailure`` naming the environment's class."""
        what = f"{type(env).__name__}.{name}"
        try:
            return await bounded(call_user(getattr(env, name), *args), self.config.env_timeout_s)
        except asyncio.TimeoutError as e:
            raise _EnvFailure(
                EndReason.ENV_TIMEOUT,
                f"{what} ran past env_timeout_s={self.config.env_timeout_s:g}",
            ) from e
        except USER_ERRORS as e:
            raise _EnvFailure(EndReason.ENV_ERROR, f"{what} raised {type(e).__name__}: {e}") from e

    async def _episode(
        self,
        env: Environment,
        traj: Trajectory,
        engine_idx: int,
        turn_texts: list[str],
        stopped: list[bool],
        sampling_seed: int | None = None,
    ) -> None:
        cfg, tok = self.config, self.tokenizer
        context = list(traj.prompt_ids)
        outcome = 0.0
        for turn in range(cfg.max_turns):
            budget = cfg.max_context_tokens - len(context)
            if budget < 1:
                traj.end_reason = EndReason.CONTEXT_LIMIT
                break
            result = await self._generate(engine_idx, traj, context, turn, budget, sampling_seed)
            if result is None:
                return
            ids, start = list(result.output_ids), len(traj.response_ids)
            traj.add_model_tokens(ids, list(result.output_logprobs))
            if cfg.routed_experts is not None:
                traj.add_routes(result.routed_experts)
            context += ids
            traj.turns.append(
                TurnRecord(
                    start,
                    len(traj.response_ids),
                    result.weight_version,
                    result.finish_reason.type.value,
                )
            )
            ended = result.finish_reason
            stop_id = bool(ids) and ids[-1] in self._sampling.stop_token_ids
            did_stop = stop_id or (
                ended.type is FinishType.STOP and ended.matched in self._sampling.stop
            )
            turn_texts.append(tok.decode(ids[:-1] if stop_id else ids))
            stopped.append(did_stop)
            if not did_stop:
                full = len(context) >= cfg.max_context_tokens
                traj.end_reason = EndReason.CONTEXT_LIMIT if full else EndReason.TURN_LENGTH
                break
            action = Action(turn_texts[-1], tuple(ids))
            step = await self._call_env(env, "step", action)
            garbage = check_step_result(step, tok.vocab_size)
            if garbage is not None:
                raise _EnvFailure(
                    EndReason.ENV_GARBAGE, f"{type(env).__name__}.step returned {garbage}"
                )
            outcome += step.reward
            traj.info.update(step.info)
            if step.done:
                traj.end_reason = EndReason.DONE
                break
            if turn == cfg.max_turns - 1:
                traj.end_reason = EndReason.MAX_TURNS
                break
            obs = step.observation
            try:
                body = tok.render_turn(step.role, obs) if isinstance(obs, str) else list(obs)
            except Exception as e:  # e.g. a chat template that rejects the role
                raise _EnvFailure(
                    EndReason.ENV_GARBAGE,
                    f"{type(env).__name__}.step returned an observation of role {step.role!r} "
                    f"the tokenizer refuses: {e}",
                ) from e
            obs_ids = self._suffix + body + self._gen_prompt
            if len(context) + len(obs_ids) >= cfg.max_context_tokens:
                traj.info["dropped_observation_tokens"] = len(obs_ids)
                traj.end_reason = EndReason.CONTEXT_LIMIT
                break
            traj.add_observation_tokens(obs_ids)
            context += obs_ids
        traj.rewards["outcome"] = outcome

    async def _generate(
        self,
        engine_idx: int,
        traj: Trajectory,
        context: list[int],
        turn: int,
        budget: int,
        sampling_seed: int | None = None,
    ) -> GenerateResult | None:
        cfg = self.config
        seed = None
        base = cfg.sampling_seed if sampling_seed is None else sampling_seed
        roots = [str(r) for r in (cfg.sampling.seed, base) if r is not None]
        if roots:
            key = "/".join([*roots, traj.uid, str(turn)]).encode()
            seed = zlib.crc32(key) & 0x7FFFFFFF
        sampling = replace(
            self._sampling, max_new_tokens=min(cfg.sampling.max_new_tokens, budget), seed=seed
        )
        routes = cfg.routed_experts is not None
        request = GenerateRequest(
            tuple(context),
            sampling,
            rid=f"{traj.uid}/t{turn}",
            session=traj.uid,
            return_routed_experts=routes,
            routed_experts_start_len=traj.routes_held if routes else 0,
        )
        try:
            async with self._slots[engine_idx]:
                result = await self.engines[engine_idx].generate(request)
        except Exception as e:
            traj.fail(EndReason.ENGINE_ERROR, f"generate raised {type(e).__name__}: {e}")
            return None
        reason = result.finish_reason
        problem = None
        if reason.type is FinishType.ABORT:
            problem = f"request aborted: {reason.message}"
        elif len(result.output_logprobs) != len(result.output_ids):
            problem = (
                f"{len(result.output_ids)} output ids but {len(result.output_logprobs)} log-probs"
            )
        elif not result.output_ids or len(result.output_ids) > sampling.max_new_tokens:
            problem = (
                f"{len(result.output_ids)} output ids for max_new_tokens={sampling.max_new_tokens}"
            )
        elif not all(0 <= t < self.tokenizer.vocab_size for t in result.output_ids):
            problem = f"output ids outside [0, {self.tokenizer.vocab_size})"
        elif routes:
            problem = _routes_problem(
                result, len(context), request.routed_experts_start_len, cfg.routed_experts
            )
        if problem is not None:
            traj.fail(EndReason.ENGINE_ERROR, problem)
            return None
        return result

    async def _score(self, traj: Trajectory, turn_texts: list[str], stopped: list[bool]) -> None:
        total = traj.rewards.setdefault("outcome", 0.0)
        if self.config.format_reward_weight:
            traj.rewards["format"] = format_reward(turn_texts, stopped)
            total += self.config.format_reward_weight * traj.rewards["format"]
        if self.reward_fns:
            inp = RewardInput(
                traj.uid,
                traj.seed,
                dict(traj.info),
                turn_texts,
                traj.rewards["outcome"],
                traj.end_reason.value,
            )
            for wr in self.reward_fns:
                try:
                    value = float(
                        await bounded(call_user(wr.fn, inp), self.config.reward_timeout_s)
                    )
                except asyncio.TimeoutError:
                    traj.fail(
                        EndReason.REWARD_ERROR,
                        f"reward {wr.fn.name!r} ran past reward_timeout_s="
                        f"{self.config.reward_timeout_s:g}",
                    )
                    return
                except USER_ERRORS as e:
                    traj.fail(
                        EndReason.REWARD_ERROR,
                        f"reward {wr.fn.name!r} failed: {type(e).__name__}: {e}",
                    )
                    return
                traj.rewards[wr.fn.name] = value
                total += wr.weight * value
        traj.reward = total


def _routes_problem(
    result: GenerateResult, context_len: int, start: int, shape: tuple[int, int, int]
) -> str | None:
    """What is wrong with the routes a turn returned (None: rows ``[start, n - 1)``, n = context
    + output tokens, each ``[layers, topk]`` distinct experts of the model, ``shape``)."""
    routes = result.routed_experts
    end = context_len + len(result.output_ids) - 1
    if routes is None:
        return "asked for routed experts, the engine returned none"
    if routes.dim() != 3 or routes.size(0) != end - start:
        return (
            f"routed experts of shape {tuple(routes.shape)}; expected [{end - start} positions "
            f"({start} to {end}), layers, topk]"
        )
    try:
        check_routes(routes, *shape)
    except RoutingError as err:
        return f"routed experts: {err}"
    return None
