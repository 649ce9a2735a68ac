"""Typed configuration of a whole RL run: ``RunConfig`` and its sections.

``RunConfig`` composes the component configs that already exist (``ModelConfig``, ``OptimConfig``
via ``TrainConfig``, ``PolicyLossConfig``, ``SamplingParams``) with the run-level sections below.
YAML files and dotted overrides map onto it through ``config.loader``. Every section validates its
own values in ``__post_init__`` and raises ``ConfigError`` naming the bad value and what would be
valid. This package is a leaf: it imports nothing else of megatron_earl, so checks that need a
component (registries of environments and advantage estimators, ``ParallelLayout`` against the
world size and the model, the tokenizer) run at start-up in ``orchestration.validate``, and
``parallel.layout.phase_layout`` turns a phase's layout string into a ``ParallelLayout``.

    seed, steps, name, output_dir, tokenizer     top-level scalars
    model        ModelConfig                     shape and numerics of the policy
    layouts      LayoutsConfig                   one layout string per phase ("tp2cp1pp1dp1")
    batch        BatchConfig                     prompts/samples per step, token budget
    rollout      RolloutConfig                   engine, turn/context limits, sampling, sglang
    env          EnvConfig                       environment name + kwargs
    train        TrainConfig(OptimConfig)        optimizer, policy loss, advantage estimator
    eval         EvalConfig                      held-out evaluation
    sft          SFTConfig                       supervised warm start on demonstrations
    checkpoint   CheckpointConfig                directory, interval, retention, load path
    logging      LoggingConfig                   JSONL, TensorBoard, progress bar
    selector     SelectorSettings                per-step layout selection (off by default)
    runtime      RuntimeConfig                   collective timeouts, hang watchdog
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from megatron_earl.config.dynamic_sampling import DynamicSamplingConfig
from megatron_earl.config.embedded import EmbeddedRolloutConfig
from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.config.model import ModelConfig
from megatron_earl.config.optim import OptimConfig
from megatron_earl.config.repack import RepackConfig
from megatron_earl.config.routing import RoutingConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.config.vocab import PHASES, EngineKind, OldLogprobs, Phase, member

DEMO_TOKENIZER_VOCAB_SIZE = 320
"""Vocabulary of the built-in demo tokenizer (``tokenizer.demo``; a unit test keeps them equal):
the default ``model.vocab_size``."""
LAYOUT_AXES = ("etp", "vpp", "tp", "cp", "pp", "dp", "ep")
"""Axes a layout string may name; missing ones are 1 (vpp and etp: None). Longer names first, so
"etp2" never reads as "tp2"."""
DIST_OPT_FORMATS = ("fully_reshardable", "dp_reshardable")
"""Distributed-optimizer checkpoint formats (``checkpoint.dist_opt_format``)."""


class ConfigError(ValueError):
    """An invalid run configuration; the message lists every problem found."""


def _require(problems: list[str], section: str) -> None:
    if problems:
        raise ConfigError(f"{section}: " + "; ".join(problems))


def _positive(obj: Any, names: tuple[str, ...], minimum: int = 1) -> list[str]:
    return [
        f"{name} ({getattr(obj, name)}) must be >= {minimum}"
        for name in names
        if getattr(obj, name) < minimum
    ]


def _seconds(obj: Any, names: tuple[str, ...], optional: bool = False) -> list[str]:
    """Problems of fields that must be a finite number of seconds > 0 (None too if
    ``optional``)."""
    problems = []
    for name in names:
        value = getattr(obj, name)
        if optional and value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and 0 < value < float("inf")):
            what = " (or null to disable)" if optional else ""
            problems.append(f"{name} ({value!r}) must be a finite number of seconds > 0{what}")
    return problems


def layout_sizes(text: str) -> dict[str, int | None]:
    """The axis sizes a layout string names: "tp2cp1pp1dp1" (any order, missing axes = 1, vpp
    and etp None) or "tp=2,dp=2"; expert parallelism as "tp1cp1pp1dp2ep2" (ep folds into the
    tp x cp x dp ranks, it does not multiply the world size; etp = expert tensor parallelism).
    Only the syntax is checked here; ``ParallelLayout`` checks the values. Raises ``ConfigError``
    on a string that is not a layout."""
    axis = "|".join(LAYOUT_AXES)
    found = re.findall(rf"({axis})\s*=?\s*(\d+)", text.lower())
    rest = re.sub(rf"({axis})\s*=?\s*\d+|[\s,x]", "", text.lower())
    if not found or rest:
        raise ConfigError(f"cannot parse layout {text!r}; expected e.g. 'tp2pp1cp1dp2'")
    sizes: dict[str, int | None] = {a: 1 for a in LAYOUT_AXES} | {"vpp": None, "etp": None}
    return sizes | {k: int(v) for k, v in found}


@dataclass(frozen=True)
class LayoutsConfig:
    """Parallel layout of each phase, as strings ("tp2cp1pp1dp1"; syntax: ``layout_sizes``).
    ``parallel.layout.phase_layout`` builds the ``ParallelLayout`` of a phase from them."""

    rollout: str = "tp1cp1pp1dp1"
    """Layout of the rollout phase (embedded engine generation)."""
    experience: str = "tp1cp1pp1dp1"
    """Layout of the experience phase (old/ref log-probs, advantages)."""
    train: str = "tp1cp1pp1dp1"
    """Layout of the training phase (policy loss, backward, optimizer step)."""

    def __post_init__(self) -> None:
        problems = []
        for phase in PHASES:
            try:
                layout_sizes(getattr(self, phase))
            except ConfigError as err:
                problems.append(f"{phase}: {err}")
        _require(problems, "layouts")

    def of(self, phase: Phase | str) -> str:
        """The layout string of ``phase``; an unknown phase raises ``ConfigError``."""
        if phase not in PHASES:
            raise ConfigError(f"unknown phase {phase!r}; valid: {PHASES}")
        return getattr(self, phase)


@dataclass(frozen=True)
class BatchConfig:
    """How much data one RL step consumes."""

    prompts_per_step: int = 8
    """Prompts (groups) rolled out per step, over all ranks."""
    samples_per_prompt: int = 4
    """Trajectories per prompt (the group size of GRPO/RLOO baselines)."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget of one packed micro-batch (experience and train phases), per rank."""
    num_mini_batches: int = 1
    """Optimizer steps per RL step (the step's samples split into this many mini-batches)."""

    def __post_init__(self) -> None:
        names = ("prompts_per_step", "samples_per_prompt", "max_tokens_per_micro_batch")
        problems = _positive(self, (*names, "num_mini_batches"))
        if not problems and self.num_mini_batches > self.samples_per_step:
            problems.append(
                f"num_mini_batches ({self.num_mini_batches}) > samples per step "
                f"({self.samples_per_step} = {self.prompts_per_step} x {self.samples_per_prompt})"
            )
        _require(problems, "batch")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


ROLLOUT_MODES = ("sync", "async")
PARTIAL_ROLLOUTS = ("continue", "restart")


def _repack_problems(r: RolloutConfig) -> list[str]:
    """What ``rollout.repack`` (drain or repack) needs: asynchronous rollout on the engines
    themselves, each fed by a relay that loads it on release."""
    what = f"repack.policy {r.repack.policy!r}"
    problems = []
    if r.mode != "async":
        problems.append(f"{what} needs mode 'async', got {r.mode!r}")
    if r.partial_rollout != "continue":
        problems.append(
            f"{what} needs partial_rollout 'continue' (no trajectory straddles a version under "
            f"it, nothing to restart), got {r.partial_rollout!r}"
        )
    if r.sglang.router_url is not None:
        problems.append(
            f"{what} routes each trajectory to an engine itself: drop sglang.router_url "
            f"({r.sglang.router_url}), the router hides which engine holds a trajectory"
        )
    if str(r.sglang.weight_update) != "relay":
        problems.append(
            f"{what} needs sglang.weight_update 'relay' (engines loaded one by one when "
            f"released), got {str(r.sglang.weight_update)!r}"
        )
    if len(r.sglang.engine_relays) != len(r.engine_urls):
        problems.append(
            f"{what} needs sglang.engine_relays, the relay of each engine_urls entry: "
            f"{len(r.sglang.engine_relays)} relays for {len(r.engine_urls)} engines"
        )
    return problems


@dataclass(frozen=True)
class RolloutConfig:
    """Multi-turn rollout limits, engine and sampling."""

    engine: EngineKind = EngineKind.EMBEDDED
    """ "embedded" (the Megatron model in the rollout layout) or "sglang" (SGLang servers)."""
    engine_urls: tuple[str, ...] = ()
    """SGLang server URLs (disaggregated servers); required with engine=sglang (the trainer does
    not start colocated SGLang servers itself)."""
    max_turns: int = 4
    """Model turns per trajectory at most."""
    max_context: int = 2048
    """Tokens in a trajectory at most (prompt + all turns); a trajectory stops when reached."""
    max_concurrency: int = 64
    """Trajectories one rank drives concurrently."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=64))
    """Sampling of each model turn, sent whole with every request: ``sampling.max_new_tokens``
    is the per-turn token limit, the tokenizer's stop ids join ``stop_token_ids``, and
    ``sampling.seed`` (with the run's ``seed``) roots the requests' seeds, a distinct one per
    request (``rollout.agent.loop.AgentLoopConfig``)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """engine=sglang: how the trainer pushes weights to the engines (``config.sglang``)."""
    embedded: EmbeddedRolloutConfig = field(default_factory=EmbeddedRolloutConfig)
    """engine=embedded: decode threads and the compiled decode step (``config.embedded``)."""
    env_timeout_s: float = 60.0
    """Limit on one environment ``reset`` / ``step`` / ``close`` call; past it the trajectory is
    FAILED (env_timeout), even if the environment ignores the cancellation."""
    reward_timeout_s: float = 60.0
    """Limit on one reward function call (local or remote); past it the trajectory is FAILED
    (reward_error)."""
    max_empty_steps: int = 3
    """Consecutive steps without enough usable trajectories (every one failed) that are skipped
    with a warning naming the failure reasons; one more stops the run with an error naming them
    (0: the first such step stops it)."""
    mode: str = "sync"
    """"sync": the EARL loop (every step waits for its rollouts, then trains); "async":
    trajectory-level asynchrony (engine=sglang): every rank keeps generating in the background,
    the trainer takes a step's groups as they finish (docs/async.md)."""
    max_staleness: int = 0
    """async: a group may start only while it is at most this many RL steps ahead of the
    trainer (AReaL's rule), and a trajectory whose oldest turn is older than this many steps at
    consumption is discarded and counted. 0 = on-policy (the synchronous loop's trajectories)."""
    partial_rollout: str = "continue"
    """async, on a weight update: "continue" (in-flight trajectories go on with the new weights;
    earlier turns keep their versions) or "restart" (in-flight trajectories are cancelled and
    started again under the new weights; their tokens are counted as wasted)."""
    async_take_timeout_s: float | None = 3600.0
    """async: the trainer stops with an error naming the producer's counts when a step's
    groups are not ready after this long (None: wait forever)."""
    max_buffered_groups: int | None = None
    """async: groups started but not yet consumed, over all ranks, at most (None: bounded by the
    staleness rule alone, (max_staleness + 1) x batch.prompts_per_step); must be >=
    batch.prompts_per_step."""
    repack: RepackConfig = field(default_factory=RepackConfig)
    """async: where trajectories run across weight versions -- none, drain (one version per
    trajectory) or repack (drain, and the long tail consolidated onto few engines);
    ``config.repack``, docs/relay.md."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """Drop groups whose rewards are all equal and draw more prompts until the step holds
    ``batch.prompts_per_step`` informative groups (DAPO; ``config.dynamic_sampling``,
    docs/training.md); off by default."""

    def __post_init__(self) -> None:
        problems = _positive(self, ("max_turns", "max_context", "max_concurrency"))
        problems += _seconds(self, ("env_timeout_s", "reward_timeout_s"))
        if isinstance(self.max_empty_steps, bool) or not isinstance(self.max_empty_steps, int):
            problems.append(f"max_empty_steps {self.max_empty_steps!r} must be an integer >= 0")
        elif self.max_empty_steps < 0:
            problems.append(
                f"max_empty_steps ({self.max_empty_steps}) must be >= 0 (consecutive empty steps "
                "skipped before the run stops; 0 stops at the first)"
            )
        if self.mode not in ROLLOUT_MODES:
            problems.append(f"mode {self.mode!r} is not one of {ROLLOUT_MODES}")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int):
            problems.append(f"max_staleness {self.max_staleness!r} must be an integer >= 0")
        elif self.max_staleness < 0:
            problems.append(
                f"max_staleness ({self.max_staleness}) must be >= 0 (0 = on-policy; k lets a "
                "trajectory start up to k RL steps before the trainer reaches it)"
            )
        if self.partial_rollout not in PARTIAL_ROLLOUTS:
            problems.append(
                f"partial_rollout {self.partial_rollout!r} is not one of {PARTIAL_ROLLOUTS}"
            )
        if self.max_buffered_groups is not None and self.max_buffered_groups < 1:
            problems.append(f"max_buffered_groups ({self.max_buffered_groups}) must be >= 1")
        if self.repack.enabled:
            problems += _repack_problems(self)
        object.__setattr__(self, "engine", member(EngineKind, self.engine, problems, "engine"))
        if self.engine_urls and self.engine != EngineKind.SGLANG:
            problems.append(f"engine_urls {list(self.engine_urls)} need engine=sglang")
        bad_urls = [u for u in self.engine_urls if not u.startswith(("http://", "https://"))]
        if bad_urls:
            problems.append(f"engine_urls {bad_urls} must start with http:// or https://")
        if self.sampling.max_new_tokens < 1:
            problems.append(
                f"sampling.max_new_tokens must be >= 1 per turn, got {self.sampling.max_new_tokens}"
            )
        if self.sampling.max_new_tokens > self.max_context:
            problems.append(
                f"sampling.max_new_tokens ({self.sampling.max_new_tokens}) > max_context "
                f"({self.max_context})"
            )
        _require(problems, "rollout")


@dataclass(frozen=True)
class RewardConfig:
    """Reward functions served by the reward service (``python -m megatron_earl.rewards.service``,
    e.g. on CPU nodes: ``REWARD_NODES`` in scripts/slurm_disaggregated.sbatch), added to the
    environment's outcome reward of every trajectory (total = outcome + sum of weight x fn)."""

    service_url: str | None = None
    """The service's base URL (http://host:port); None: no remote reward."""
    fns: tuple[str, ...] = ()
    """Names of the service's functions to call (checked against its /health at start-up)."""
    weights: tuple[float, ...] = ()
    """One weight per function; empty: 1.0 each."""
    timeout_s: float = 10.0
    """Per-request timeout."""
    retries: int = 3
    """Retries (exponential backoff) on connection errors, timeouts and 5xx answers; a
    trajectory whose reward still fails is FAILED (counted, not trained on)."""

    def __post_init__(self) -> None:
        problems = []
        if self.service_url is not None and not self.service_url.startswith(
            ("http://", "https://")
        ):
            problems.append(f"service_url {self.service_url!r} must start with http:// or https://")
        if bool(self.service_url) != bool(self.fns):
            problems.append(
                f"service_url ({self.service_url!r}) and fns ({list(self.fns)}) go together: "
                "give both (the functions to call on the service) or neither"
            )
        if self.weights and len(self.weights) != len(self.fns):
            problems.append(
                f"weights {list(self.weights)} must have one entry per fn {list(self.fns)} "
                "(or be empty: 1.0 each)"
            )
        if not self.timeout_s > 0:
            problems.append(f"timeout_s ({self.timeout_s}) must be > 0")
        if self.retries < 0:
            problems.append(f"retries ({self.retries}) must be >= 0")
        _require(problems, "reward")

    def weighted(self) -> list[tuple[str, float]]:
        """(fn, weight) pairs."""
        return list(zip(self.fns, self.weights or [1.0] * len(self.fns), strict=True))


@dataclass(frozen=True)
class EnvConfig:
    """Which environment the agent loop runs (``megatron_earl.envs.ENVS``; the name is checked
    against the registry at start-up, ``orchestration.validate``)."""

    name: str = "arithmetic"
    """Registered environment name or a dotted path "pkg.module:Class"."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (checked at pre-flight by
    constructing it once, ``orchestration.validate``)."""

    def __post_init__(self) -> None:
        _require([] if self.name else ["name must not be empty"], "env")

    def spec(self) -> dict[str, Any]:
        """The spec ``ENVS.build`` takes."""
        return {"name": self.name, "kwargs": dict(self.kwargs)}


@dataclass(frozen=True)
class TrainConfig(OptimConfig):
    """Training phase: the optimizer settings (inherited from ``OptimConfig``, so this object is
    passed to ``build_optimizer`` as is), the policy loss and the advantage estimator (its name
    and kwargs are checked against ``training.advantages`` at start-up,
    ``orchestration.validate``)."""

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss (PPO/GSPO clipping, KL, entropy, off-policy correction, aggregation)."""
    advantage: str = "grpo"
    """Advantage estimator name (``training.advantages``: grpo, rloo, reinforce_pp)."""
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)
    """Fields of the estimator, e.g. {scale_by_std: false} for Dr.GRPO."""
    old_logprobs: OldLogprobs = OldLogprobs.AUTO
    """ "auto": the experience phase computes old log-probs only when they can differ from the
    train pass's own log-probs before the update (``RunConfig.old_logprobs_pass``), else the
    loss takes those (ratio exactly 1) and the step saves a forward pass; "always": every
    step."""
    prefix_sharing: bool = True
    """Pack the prompt a group's samples share once per micro-batch in the train and log-prob
    passes (``training.prefix_tree``: the same results as packing every sample whole, fewer
    tokens computed). Applies where the phase's layout has cp = 1, the model has no dropout and
    runs the local spec's SDPA attention; elsewhere every sample is packed whole. The dispatcher
    then keeps a group's samples on one DP rank when there are 2 groups per rank or more."""
    skip_zero_advantage: bool = True
    """Leave out of the experience and train phases the samples whose every trainable advantage
    is 0 (a group with all-equal rewards under a group baseline), where their terms in the loss
    and its gradients are exactly 0: one mini-batch, kl_coef = entropy_coef = 0, no dropout and a
    loss whose terms are advantage-weighted (every built-in one); the loss normaliser still
    counts them, so the update is the same up to float summation order. At least one sample per
    DP rank stays (``orchestration.zero_advantage``). False: compute them all, as TRL and verl
    do."""

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = [] if self.advantage else ["advantage must not be empty"]
        object.__setattr__(
            self,
            "old_logprobs",
            member(OldLogprobs, self.old_logprobs, problems, "old_logprobs"),
        )
        _require(problems, "train")

    def optim(self) -> OptimConfig:
        """Just the optimizer settings, as a plain ``OptimConfig``."""
        return OptimConfig(**{f.name: getattr(self, f.name) for f in fields(OptimConfig)})


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (prompts from seeds the training stream never uses)."""

    num_prompts: int = 0
    """Held-out prompts per evaluation; 0 disables evaluation."""
    interval: int = 0
    """Evaluate every this many steps (0: only before the first and after the last step)."""
    seed_offset: int = 1_000_000
    """Environment seeds of held-out prompts start here (training seeds stay below)."""
    temperature: float = 0.0
    """Sampling temperature of evaluation (0 = greedy)."""
    samples_per_prompt: int = 1
    """Trajectories per held-out prompt (with temperature > 0: the success rate is an average
    over samples, i.e. the policy's expected success, not one draw's)."""

    def __post_init__(self) -> None:
        problems = _positive(self, ("num_prompts", "interval", "seed_offset"), minimum=0)
        problems += _positive(self, ("samples_per_prompt",))
        if self.temperature < 0:
            problems.append(f"temperature ({self.temperature}) must be >= 0")
        _require(problems, "eval")


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start on the environment's generated demonstrations (before RL)."""

    steps: int = 0
    """Optimizer steps (0 disables the warm start)."""
    examples_per_step: int = 32
    """Demonstrations per optimizer step, over all DP ranks."""
    lr: float | None = None
    """Learning rate of the warm start (None: train.lr)."""
    weak_teacher_fraction: float = 0.0
    """Fraction of demonstrations from a weak teacher that answers at once with a guess instead
    of using the tool (a realistic imperfect warm start for RL to improve on)."""
    seed_offset: int = 2_000_000
    """Environment seeds of demonstrations start here (disjoint from RL and eval seeds)."""

    def __post_init__(self) -> None:
        problems = _positive(self, ("steps",), minimum=0) + _positive(self, ("examples_per_step",))
        if not 0.0 <= self.weak_teacher_fraction <= 1.0:
            problems.append(
                f"weak_teacher_fraction ({self.weak_teacher_fraction}) must be in [0, 1]"
            )
        if self.lr is not None and self.lr <= 0:
            problems.append(f"lr ({self.lr}) must be > 0")
        _require(problems, "sft")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often checkpoints are written, how many are kept, what to start from."""

    dir: str | None = None
    """Checkpoint directory; None means ``<output_dir>/<name>/checkpoints`` in a run
    (``RunConfig.checkpoint_dir``); ``save_checkpoint`` needs it set."""
    interval: int = 0
    """Save every this many steps (0: only at the end of the run)."""
    keep_last: int = 2
    """Retention: keep the newest this many checkpoints (0 keeps all)."""
    keep_every: int = 0
    """Retention: also keep every checkpoint whose step is a multiple of this (0: none)."""
    load: str | None = None
    """Initial weights (must exist): a Hugging Face model directory or a Megatron checkpoint in
    any layout; weights only, the run starts at step 0. None: random initialisation."""
    resume: bool = True
    """Resume from the newest checkpoint in ``dir`` when there is one (overrides ``load``)."""
    dist_opt_format: str | None = None
    """Distributed-optimizer state format: "fully_reshardable" (gathered per DP group on save,
    loads in any layout), "dp_reshardable" (fully parallel, reshards over DP only) or None: the
    former with Apex/TE optimizers, the latter on the torch-Adam fallback (megatron-core 0.16.1
    cannot load fully_reshardable state into torch Adam: KeyError 'step')."""
    on_signal: bool = False
    """On SIGTERM / SIGINT (to a rank, or to ``megatron-earl train``, which passes it on), every
    rank finishes the current step, saves a checkpoint and exits; False: the ranks stop at once
    (the newest periodic checkpoint is the resume point)."""
    on_signal_grace_s: float = 600.0
    """With ``on_signal``: how long ``megatron-earl train`` waits for that final checkpoint
    after a signal before it kills every process of the run (a second signal kills at once)."""

    def __post_init__(self) -> None:
        problems = _positive(self, ("interval", "keep_last", "keep_every"), minimum=0)
        problems += _seconds(self, ("on_signal_grace_s",))
        if self.dist_opt_format not in (None, *DIST_OPT_FORMATS):
            problems.append(
                f"dist_opt_format {self.dist_opt_format!r} is not one of {DIST_OPT_FORMATS}"
            )
        _require(problems, "checkpoint")


@dataclass(frozen=True)
class LoggingConfig:
    """What the run reports while it runs (rank 0 only)."""

    jsonl: bool = True
    """Write ``metrics.jsonl`` (one line per step) in the run directory."""
    tensorboard: bool = True
    """Write TensorBoard scalars (skipped with a warning when ``tensorboard`` is not installed)."""
    tensorboard_dir: str | None = None
    """TensorBoard directory; None means ``<run dir>/tensorboard``."""
    progress: bool = True
    """Show the progress bar on stderr."""
    log_interval: int = 1
    """Print a full progress line every this many steps when stderr is not a terminal."""

    def __post_init__(self) -> None:
        _require(_positive(self, ("log_interval",)), "logging")


@dataclass(frozen=True)
class SelectorSettings:
    """Per-step parallel layout selection of the experience, train (and rollout) phases from the
    batch's context lengths and a per-rank memory budget (``megatron_earl.selector``;
    docs/selector.md). Selecting ``train`` moves the trainable master copy (weights and Adam
    state) between layouts when the decision changes."""

    enabled: bool = False
    """Select layouts per step; False runs every phase in its ``layouts`` entry."""
    budget_mb: float = 81920.0
    """Per-rank memory budget (MiB): enforced by the project on CPU (a phase past it is an OOM),
    the device memory the selector plans with on GPU."""
    phases: tuple[Phase, ...] = (Phase.EXPERIENCE, Phase.TRAIN)
    """Phases to select a layout for: any of "rollout", "experience", "train" (rollout candidates
    are tp/dp only: the embedded engine needs pp = cp = 1; "train" needs the plain optimizer)."""
    safety_margin: float = 0.1
    """A layout fits when its predicted peak x (1 + safety_margin) <= budget; in [0, 1)."""
    switch_gain: float = 0.1
    """Leave a layout that still fits only for a predicted speed-up above this (relative)."""
    profile: bool = True
    """Before the first step, run the selected experience/train phases on synthetic batches in
    every candidate layout: calibrates the memory model per (phase, layout) and fills the
    throughput table (skipped on resume: the checkpoint has both)."""
    profile_lengths: tuple[int, ...] = ()
    """Sequence lengths of the profiling batches (``batch.samples_per_step`` sequences each);
    empty: token budget / (2 x samples) and 2 x token budget / samples (docs/selector.md)."""
    measure_above: float = 0.0
    """CPU only: measure a live phase run's peak memory (the project's accounting hooks every
    ATen op, several times slower on a tiny model) only when its predicted peak is at least this
    fraction of ``budget_mb``; a run predicted below it is neither measured, held to the budget
    nor a calibration point. 0 measures every run; in [0, 1]. Start-up profiling and GPU runs
    are always measured."""

    def __post_init__(self) -> None:
        problems = []
        if any(n < 1 for n in self.profile_lengths):
            problems.append(f"profile_lengths {list(self.profile_lengths)} must be >= 1")
        if self.budget_mb <= 0:
            problems.append(f"budget_mb ({self.budget_mb}) must be > 0")
        bad = [p for p in self.phases if p not in PHASES]
        if bad or not self.phases:
            problems.append(
                f"phases {list(self.phases)} must be a non-empty subset of {PHASES} "
                "(pick any of them)"
            )
        else:
            object.__setattr__(self, "phases", tuple(Phase(p) for p in self.phases))
        if not 0 <= self.safety_margin < 1:
            problems.append(f"safety_margin ({self.safety_margin}) must be in [0, 1)")
        if self.switch_gain < 0:
            problems.append(f"switch_gain ({self.switch_gain}) must be >= 0")
        if not 0 <= self.measure_above <= 1:
            problems.append(f"measure_above ({self.measure_above}) must be in [0, 1]")
        _require(problems, "selector")


@dataclass(frozen=True)
class RuntimeConfig:
    """How the run's processes guard against hangs (docs/reliability.md)."""

    collective_timeout_s: float = 1800.0
    """Timeout of every collective, on every process group of the run (the world, every group
    of every layout, their host twins): a rank waiting longer for a peer fails with the
    collective's error instead of hanging (Megatron-Core's own default is 30 minutes for its
    groups). Raise it when ranks can legitimately wait longer at one collective (a very long
    rollout on some ranks while others wait)."""
    watchdog_timeout_s: float | None = 300.0
    """Every rank beats a heartbeat (a thread) and records its current activity (rollout,
    experience, train, checkpoint ...); a rank whose heartbeat is older than this (a stopped or
    frozen process) makes the others stop the job with an error naming its rank, host, pid,
    activity and step. None: no watchdog."""

    def __post_init__(self) -> None:
        problems = _seconds(self, ("collective_timeout_s",))
        problems += _seconds(self, ("watchdog_timeout_s",), optional=True)
        _require(problems, "runtime")


@dataclass(frozen=True)
class RunConfig:
    """Everything one RL run needs; ``config.loader.load_config`` builds it from YAML."""

    name: str = "run"
    """Run name: the run directory is ``<output_dir>/<name>``."""
    seed: int = 1234
    """Seed of model init, data order and sampling."""
    steps: int = 10
    """RL steps to run (a resumed run stops at the same total)."""
    output_dir: str = "runs"
    """Parent directory of run directories (resolved config, metrics, checkpoints)."""
    tokenizer: str = "demo"
    """ "demo" (the built-in tokenizer) or a local Hugging Face tokenizer directory."""
    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(vocab_size=DEMO_TOKENIZER_VOCAB_SIZE)
    )
    """Policy model shape and numerics (default: a tiny model over the demo tokenizer)."""
    layouts: LayoutsConfig = field(default_factory=LayoutsConfig)
    """Parallel layout of each phase."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Batch sizes and token budget."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engine, limits and sampling."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environment."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Remote reward functions (the reward service), added to the environment's reward."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer, policy loss and advantages."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start before RL."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and progress."""
    selector: SelectorSettings = field(default_factory=SelectorSettings)
    """Per-step layout selection of the ``selector.phases`` (off by default)."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Collective timeouts and the hang watchdog."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """Routing replay of a mixture-of-experts model (``config.routing``)."""

    def __post_init__(self) -> None:
        problems = _positive(self, ("steps",)) + _positive(self, ("seed",), minimum=0)
        if not self.name or "/" in self.name:
            problems.append(f"name {self.name!r} must be a non-empty directory name (no '/')")
        if self.rollout.dynamic_sampling.enabled:
            problems += self._dynamic_sampling_problems()
        _require(problems, "run")

    def _dynamic_sampling_problems(self) -> list[str]:
        """``rollout.dynamic_sampling`` against the other sections: its metric must be a reward
        the trajectories carry, its extra prompts' seeds must not be training or held-out
        ones."""
        ds = self.rollout.dynamic_sampling
        problems = []
        names = ds.metric_names(self.reward.fns)
        if ds.metric not in names:
            problems.append(
                f"rollout.dynamic_sampling.metric {ds.metric!r} is not a reward of this run; "
                f"valid: {names} (the total, the environment's outcome, reward.fns)"
            )
        first, n = ds.seed_offset, self.steps * ds.extra_prompt_cap(self.batch.prompts_per_step)
        taken = {
            "training": (0, self.steps * self.batch.prompts_per_step),
            "eval": (self.eval.seed_offset, self.eval.seed_offset + self.eval.num_prompts),
        }
        for what, (lo, hi) in taken.items():
            if first < hi and lo < first + n:
                problems.append(
                    f"rollout.dynamic_sampling.seed_offset ({first}): the extra prompts' seeds "
                    f"[{first}, {first + n}) overlap the {what} seeds [{lo}, {hi})"
                )
        return problems

    def old_logprobs_pass(self) -> bool:
        """Whether the experience phase computes old log-probs (``train.old_logprobs``). "auto"
        skips them when they cannot differ from what the train pass computes itself: with one
        mini-batch per step the train forward runs on the weights the rollout used (the loop
        syncs the rollout engines to the current version before every rollout; the advantage
        estimators read rewards only), so its detached log-probs are pi_old (every loss, the TIS
        weight and the rollout/train mismatch metric then read them); without dropout both
        forwards are deterministic. Several mini-batches (later ones train on updated weights)
        or dropout need the separate pass. The reference pass (``kl_coef > 0``) is separate."""
        if self.train.old_logprobs == OldLogprobs.ALWAYS:
            return True
        dropout = self.model.attention_dropout > 0 or self.model.hidden_dropout > 0
        return self.batch.num_mini_batches > 1 or dropout

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    @property
    def tensorboard_dir(self) -> Path:
        tb = self.logging.tensorboard_dir
        return Path(tb) if tb else self.run_dir / "tensorboard"
