"""The SPMD RL loop: every rank runs this same loop; there is no driver process.

One step, with the per-phase layouts of the run config:

    rollout     the run's rollout backend (``orchestration.engines``, chosen once from
                ``rollout.engine``): sync its weights, generate this rank's share of the
                prompts -- embedded: reshard policy -> R, agent loops on the engine in R
                (trajectories on TP rank 0 of each replica); sglang: push weights if stale,
                drive the servers from every rank. With ``rollout.dynamic_sampling``, groups
                whose rewards are all equal are dropped and extra rounds of prompts drawn in
                their place (``orchestration.dynamic_sampling``). GRPO advantages where the
                groups are.
    experience  use_layout(E); reshard policy -> E; dispatch R -> E; old log-probs (only when
                ``RunConfig.old_logprobs_pass``: several mini-batches, dropout, or
                ``train.old_logprobs: always``) and, with ``train.loss.kl_coef > 0``, ref
                log-probs of the frozen reference policy, kept in E (``training.reference``);
                reverse path E -> the rollout ranks. Neither: the phase does nothing.
    train       use_layout(T); dispatch R -> T; RL train step(s); weight version + 1. Without old
                log-probs the loss takes the train forward's own (on-policy), and that forward
                also gives the rollout/train mismatch metric
    checkpoint  every ``checkpoint.interval`` steps (atomic, any layout on load)

Every plan (prompt split, dispatch, reshard) is computed on every rank from all-gathered metadata.
Per-phase timings, layouts, rewards, lengths and losses go to the metrics log every step.

With ``selector.enabled`` the layouts of ``selector.phases`` (experience and train by default,
rollout optionally) are chosen per step from the all-gathered sequence lengths
(``orchestration.selection``, after start-up profiling: ``orchestration.profiling``): the policy
copy of a layout (and the backend's engine there) is built the first time it is chosen and
cached; a new train layout moves the master copy and its Adam state there
(``Policy.move_master``); an out-of-budget phase is re-run on the same data in the next layout
(the train phase continues with the mini-batches it had not applied).

Which ranks call: every rank of the world (``run`` under torchrun / srun).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_earl import runtime
from megatron_earl.config.model import sequence_parallel_size
from megatron_earl.config.run import RunConfig
from megatron_earl.config.vocab import Activity, EngineKind, Phase
from megatron_earl.dispatch import Destination
from megatron_earl.dispatch.execute import PlanCache, execute, plan_for
from megatron_earl.dispatch.reverse import return_results
from megatron_earl.models.impl import pin_transformer_impl
from megatron_earl.models.routing import Disagreement, RouteAction
from megatron_earl.orchestration.async_rollout import (
    AsyncProducer,
    GroupPlan,
    Taken,
    async_metrics,
    group_ids,
)
from megatron_earl.orchestration.dynamic_sampling import DynamicSampler
from megatron_earl.orchestration.engines import Rollout, rollout_backend_class
from megatron_earl.orchestration.policy import Policy
from megatron_earl.orchestration.rollout import PromptSet, agent_config, group_index
from megatron_earl.orchestration.samples import (
    consumer_plan,
    model_inputs,
    replica_layout,
    schema_batch,
    shares_prefixes,
    trajectories_to_batch,
    with_token_field,
)
from megatron_earl.orchestration.selection import PhaseSelection, gathered_lengths
from megatron_earl.orchestration.sft import warm_start
from megatron_earl.orchestration.step_metrics import rollout_metrics
from megatron_earl.orchestration.watchdog import Heartbeat
from megatron_earl.orchestration.zero_advantage import (
    NO_SKIP,
    SkipCounts,
    skip_rule,
    skip_zero_advantage,
)
from megatron_earl.parallel.groups import host_group
from megatron_earl.parallel.layout import ParallelLayout, phase_layout
from megatron_earl.parallel.oom_agreement import agreement_point
from megatron_earl.parallel.state import use_layout
from megatron_earl.rewards.service import check_reward_service, remote_rewards
from megatron_earl.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_earl.rollout.agent.trajectory import Trajectory
from megatron_earl.rollout.repack import Placement, relay_holders, release_holder_problems
from megatron_earl.selector.budget import state_bytes
from megatron_earl.selector.profile import BusyClock
from megatron_earl.training.advantages import build_estimator
from megatron_earl.training.microbatch import ROUTES
from megatron_earl.training.reference import ReferenceConfig, ReferencePolicy
from megatron_earl.training.rl_step import RLStepConfig, micro_batch_logprobs, train_micro_batches
from megatron_earl.training.setup import build_lr_scheduler, set_lr_step

SAMPLE_ID_STRIDE = 1_000_000
"""Sample ids of rollout source d (replica or rank) start at d * SAMPLE_ID_STRIDE."""


class RLLoop:
    """State of one run on this rank: the policy in every phase layout, the rollout backend,
    the step."""

    def __init__(self, config: RunConfig, tokenizer, heartbeat: Heartbeat | None = None) -> None:
        self.heartbeat = heartbeat or Heartbeat()
        """Told which phase runs (``Activity``), for the hang watchdog."""
        embedded = config.rollout.engine == EngineKind.EMBEDDED
        config = dataclasses.replace(
            config, model=pin_transformer_impl(config.model, embedded_engine=embedded)
        )
        self.config = config
        self.tokenizer = tokenizer
        self.layouts = {phase: phase_layout(config.layouts, phase) for phase in Phase}
        self.old_logprobs = config.old_logprobs_pass()
        """Whether the experience phase computes old log-probs (else the train pass does)."""
        self.skip_rule = skip_rule(config)
        """How zero-advantage samples leave the step (None: they stay; ``zero_advantage``)."""
        self.plan_cache = PlanCache()
        """Dispatch plans by their exact inputs (a re-run of a phase reuses its plan)."""
        self._disagreement = Disagreement()
        """The step's measured routes (``routing_metrics`` takes them)."""
        kind = rollout_backend_class(config.rollout.engine)
        layouts = kind.policy_layouts(self.layouts)
        if not self.old_logprobs:  # the experience phase never runs the policy
            layouts.pop(Phase.EXPERIENCE)
        asyncio.run(check_reward_service(config.reward))  # before anything is built
        if config.rollout.repack.enabled:
            check_engine_relays(config.rollout.sglang.engine_relays)
        self.policy = Policy.build(config.model, layouts, config.train.optim(), config.seed)
        self.backend = kind(config, self.policy, tokenizer)
        self.sync_stats: dict[str, float] = {}
        """What the last ``backend.sync_weights`` cost (logged as ``sync/<key>``)."""
        self.reference: ReferencePolicy | None = None
        """The frozen reference policy in the experience layout (``kl_coef > 0`` only); its
        weights are the policy's at the first experience phase (``freeze_reference``) unless
        loaded before (resume)."""
        if config.train.loss.kl_coef > 0:
            with runtime.preserved_rng():
                runtime.seed(config.seed)
                self.reference = ReferencePolicy(
                    config.model,
                    ReferenceConfig(
                        layout=self.layouts[Phase.EXPERIENCE],
                        max_tokens_per_micro_batch=config.batch.max_tokens_per_micro_batch,
                        vocab_size=config.model.vocab_size,
                    ),
                )
        use_layout(self.layouts[Phase.TRAIN])
        self.estimator = build_estimator(config.train.advantage, **config.train.advantage_kwargs)
        self.step = 0
        self.active = dict(self.layouts)
        """Layout each phase last ran in (the selector's choice; ``layouts`` when it is off)."""
        self.selection = None
        if config.selector.enabled:
            self.selection = PhaseSelection(config, dist.get_world_size())
        self.last_lengths: list[int] = []
        self.producer: AsyncProducer | None = None
        """``rollout.mode: async``: this rank's background generation (built at the first step)."""
        self.taken: Taken | None = None
        """``rollout.mode: async``: what the last step took from the producer."""
        self.empty_steps = 0
        """Steps in a row skipped for want of usable trajectories (``rollout.max_empty_steps``)."""
        self.usable = 0
        """Usable (OK) trajectories of the last step over all ranks."""
        self.sampler: DynamicSampler | None = None
        """``rollout.dynamic_sampling`` in the synchronous loop (the async producer filters
        itself: ``_build_producer``)."""
        if config.rollout.dynamic_sampling.enabled and config.rollout.mode == "sync":
            self.sampler = DynamicSampler(config)
        self.sampling_metrics: dict[str, float] = {}
        """What dynamic sampling did in the last step (``dynamic_sampling/*``)."""

    def warm_start(self, env=None) -> None:
        """``config.sft.steps`` SFT steps on the master copy (``orchestration.sft``) on
        ``env`` (an env spec; default the run's), counted in the weight version. Every rank
        calls, in the train layout."""
        cfg = self.config
        use_layout(self.policy.train_layout)
        warm_start(
            self.policy.ddp_chunks,
            self.policy.optimizer,
            cfg.sft,
            env or cfg.env.spec(),
            self.tokenizer,
            max_tokens_per_micro_batch=cfg.batch.max_tokens_per_micro_batch,
            vocab_size=cfg.model.vocab_size,
        )
        self.policy.version += cfg.sft.steps

    def profile(self) -> list[str]:
        """Start-up profiling of the selected phases in every candidate layout
        (``orchestration.profiling``); one line per run. Every rank calls."""
        from megatron_earl.orchestration.profiling import profile_start_up

        return profile_start_up(self)

    def release_unused(self) -> None:
        """Drop the policy copies and engines of layouts no phase uses now (the selector's
        earlier choices, the profiling's candidates): one copy of the model per visited layout
        would otherwise stay resident. Local."""
        keep = {*self.active.values(), self.policy.train_layout}
        self.policy.retain(keep)
        self.backend.retain(keep)

    def freeze_reference(self) -> None:
        """Copy the policy's current weights into the reference policy (point-to-point reshard
        from the master copy into the experience layout); a no-op without a reference.
        ``orchestration.run`` calls it once before the first evaluation (then saves the
        reference); an ``RLLoop`` driven directly gets it at its first experience phase.
        Every rank calls."""
        if self.reference is not None:
            self.reference.load_from(self.policy.master_pieces)

    def prepare(self, layout: ParallelLayout) -> None:
        """Activate ``layout`` and build the policy's copy in it if needed (the selector's
        switch; the phase syncs the weights). Every rank calls."""
        use_layout(layout)
        self.policy.ensure(layout)

    def resident_bytes(self, layout: ParallelLayout) -> int:
        """State a phase in ``layout`` holds, as the memory model counts it: the master copy's
        weights, gradients and Adam state, plus ``layout``'s own weights when it is another."""
        total = state_bytes(self.policy.ddp_chunks, self.policy.optimizer)
        if layout != self.policy.train_layout:
            total += state_bytes(self.policy.copies[layout].chunks)
        if self.reference is not None:
            total += state_bytes(self.reference.chunks)
        return total

    # ------------------------------------------------------------------ phases

    def rollout(
        self, prompts: PromptSet, agent: AgentLoopConfig, layout: ParallelLayout | None = None
    ) -> Rollout:
        """Generate with the current policy on the run's backend. Returns this rank's
        trajectories and its source index (distinct per rank that holds trajectories; None on
        ranks that hold none)."""
        layout = layout or self.active[Phase.ROLLOUT]
        if self.producer is None:
            self.sync_stats = self.backend.sync_weights(layout)
        else:  # an evaluation mid-run in async mode: the producer sees the push as a step's
            self.producer.begin_update()
            self.sync_stats = self.backend.sync_weights(layout)
            self.producer.end_update(self.policy.version, self.step)
        return self.backend.generate(prompts, agent, layout)

    def experience_work(self) -> bool:
        """Whether the experience phase computes anything (old or ref log-probs)."""
        return self.old_logprobs or self.reference is not None

    def experience(self, batch, layout: ParallelLayout | None = None):
        """Old log-probs of every sample in the experience layout (when ``self.old_logprobs``)
        and ref log-probs of the reference policy (when there is one), returned to the owners;
        ``batch`` unchanged when there is neither. Every rank calls."""
        if not self.experience_work():
            return batch
        layout = layout or self.layouts[Phase.EXPERIENCE]
        use_layout(layout)
        if self.old_logprobs:
            self.policy.sync(layout)
        fields = ("tokens", "labels", "loss_mask", *([ROUTES] if self._routes else ()))
        used = [self.policy.chunks(layout)] if self.old_logprobs else []
        if self.reference is not None:
            used.append(self.reference.chunks)
        share = shares_prefixes(self.config, layout, used)
        plan = plan_for(
            batch,
            every_stage(layout, Phase.EXPERIENCE, fields),
            consumer_plan(layout, self.config.batch.max_tokens_per_micro_batch, 1, share),
            cache=self.plan_cache,
        )
        local = execute(plan, batch)
        routing = self._routing(Phase.EXPERIENCE)
        inputs = model_inputs(
            local.micro_batches, fields, layout.cp, self._sp(layout), share, routing
        )
        names = []
        if self.old_logprobs:
            out = micro_batch_logprobs(
                self.policy.chunks(layout), inputs, vocab_size=self.config.model.vocab_size
            )
            if out is not None:
                for mb, values in zip(local.micro_batches, out, strict=True):
                    mb.fields["old_logprobs"] = values
            names.append("old_logprobs")
        if self.reference is not None:
            # start-up validation keeps the experience layout fixed when there is a reference
            assert layout == self.reference.config.layout, (layout, self.reference.config.layout)
            if not self.reference.loaded:
                self.freeze_reference()
            # the reference policy routes natively: the rollout's routes are the policy's
            ref = self.reference.micro_batch_logprobs([_unrouted(mb) for mb in inputs])
            if ref is not None:
                for mb, values in zip(local.micro_batches, ref, strict=True):
                    mb.fields["ref_logprobs"] = values
            names.append("ref_logprobs")
        agreement_point()  # an OOM on another rank in the forward passes: raise before the return
        self._measured(routing)
        back = return_results(plan, local, names)
        for name in names:
            batch = with_token_field(batch, name, back.token_fields.get(name, torch.empty(0)))
        return batch

    def train(
        self,
        batch,
        layout: ParallelLayout | None = None,
        progress: TrainProgress | None = None,
        update: bool = True,
        skipped: SkipCounts = NO_SKIP,
    ) -> dict[str, float]:
        """Dispatch to the train layout (moving the master copy there if it is elsewhere) and
        take ``num_mini_batches`` optimizer steps. ``progress`` counts the mini-batches already
        applied, so a re-run after an OOM continues with the next one (no sample trained twice).
        ``update=False`` (start-up profiling): forward and backward, no optimizer step.
        ``skipped``: the zero-advantage samples left out of ``batch`` (``skip_zero_advantage``)."""
        layout = layout or self.policy.train_layout
        self.move_master(layout)
        budget = self.config.batch.max_tokens_per_micro_batch
        n = self.config.batch.num_mini_batches
        fields = tuple(sorted(batch.token_fields))
        share = shares_prefixes(self.config, layout, [self.policy.ddp_chunks])
        plan = plan_for(
            batch,
            every_stage(layout, Phase.TRAIN, fields),
            consumer_plan(layout, budget, n, share),
            cache=self.plan_cache,
        )
        local = execute(plan, batch)
        step_config = RLStepConfig(
            loss=self.config.train.loss,
            max_tokens_per_micro_batch=budget,
            vocab_size=self.config.model.vocab_size,
            skipped_normaliser=skipped.normaliser,
        )
        optimizer = self.policy.optimizer if update else _NoUpdate(self.policy.optimizer)
        if self.selection is not None:
            optimizer = self.selection.guard(optimizer)
        progress = progress or TrainProgress()
        for i in range(progress.done, n):
            if update:  # the schedule's rate at this RL optimizer step (SFT steps not counted)
                set_lr_step(self._lr_scheduler(), self.policy.version - self.config.sft.steps)
            routing = self._routing(Phase.TRAIN)
            whole = model_inputs(
                local.mini_batch(i), fields, layout.cp, self._sp(layout), share, routing
            )
            progress.metrics = train_micro_batches(
                self.policy.ddp_chunks, optimizer, whole, step_config
            )
            self._measured(routing)
            if update:
                self.policy.version += 1
            progress.done = i + 1
        return progress.metrics

    @property
    def _routes(self) -> tuple[int, int] | None:
        """(MoE layers, topk) of the samples' ``routed_experts`` when ``routing`` records
        them, else None."""
        if not self.config.routing.records:
            return None
        return self.config.model.num_layers, self.config.model.moe_router_topk

    def _routing(self, phase: Phase) -> RouteAction | Disagreement | None:
        """What ``phase``'s forwards do with the rollout's routes: replay them, measure their
        own routing against them (into a fresh counter, kept by ``_measured`` once the work it
        counted has completed: an OOM re-run counts nothing twice), or nothing (no routes)."""
        if self._routes is None:
            return None
        return RouteAction.REPLAY if self.config.routing.replays(phase) else Disagreement()

    def _measured(self, routing: RouteAction | Disagreement | None) -> None:
        if isinstance(routing, Disagreement):
            self._disagreement.merge(routing)

    def routing_metrics(self) -> dict[str, float]:
        """``routing/disagreement``: the fraction of (token, layer) routes the measured forwards
        of the step routed differently from the engine (every rank's routers, summed over the
        world; one host read and one all-reduce; every rank calls). Empty when nothing was
        measured."""
        if self._routes is None:
            return {}
        taken = self._disagreement.take()
        counts = torch.zeros(2, dtype=torch.float64)
        if taken is not None:
            counts = runtime.to_host(torch.stack(taken)).double()
        dist.all_reduce(counts, group=host_group())
        if counts[1] == 0:
            return {}
        return {
            "routing/disagreement": float(counts[0] / counts[1]),
            "routing/compared": float(counts[1]),
        }

    def _sp(self, layout: ParallelLayout) -> int:
        """Ranks that split a packed micro-batch's sequence in ``layout`` (tp under sequence
        parallelism, else 1): its inputs are padded so each rank's share divides by it."""
        return sequence_parallel_size(self.config.model, layout.tp)

    def _lr_scheduler(self):
        """Megatron-Core's LR scheduler over the master's current optimizer (rebuilt when the
        master moves and gets a new optimizer); the run has ``steps x num_mini_batches`` RL
        optimizer steps."""
        cached = getattr(self, "_lr_cache", None)
        if cached is None or cached[0] is not self.policy.optimizer:
            total = self.config.steps * self.config.batch.num_mini_batches
            scheduler = build_lr_scheduler(self.policy.optimizer, self.config.train, total)
            self._lr_cache = (self.policy.optimizer, scheduler)
        return self._lr_cache[1]

    def move_master(self, layout: ParallelLayout) -> None:
        """Make ``layout`` the train layout: the master copy (weights and Adam state) moves
        there; the backend drops what it built over the old and new master chunks (rebuilt on
        demand). Activates ``layout``. Every rank calls."""
        old = self.policy.train_layout
        if layout != old:
            self.policy.move_master(layout)
            self.backend.master_moved(old, layout)
        use_layout(layout)

    # ------------------------------------------------------------------ one step

    def selected(self, phase: str) -> bool:
        """Whether the selector chooses ``phase``'s layout this run (not the experience phase's
        when it computes nothing)."""
        if phase == Phase.EXPERIENCE and not self.experience_work():
            return False
        return self.selection is not None and phase in self.selection.phases

    def step_seeds(self, step: int) -> tuple[int, ...]:
        n = self.config.batch.prompts_per_step
        return tuple(range(step * n, (step + 1) * n))

    def run_step(self) -> dict[str, float | str]:
        """One RL step (every rank). Returns the step's metrics (the same on every rank)."""
        cfg = self.config
        clock = BusyClock()
        start = time.perf_counter()
        prompts = PromptSet(cfg.env.spec(), self.step_seeds(self.step), tag=f"s{self.step}")
        agent = agent_config(
            cfg,
            group_size=cfg.batch.samples_per_prompt,
            temperature=cfg.rollout.sampling.temperature,
            seed=cfg.seed * 1_000_003 + self.step,
        )
        selected: dict[str, float | str] = {}
        self.sync_stats = {}
        self.sampling_metrics = {}
        with clock(Phase.ROLLOUT), self.heartbeat.activity(Activity.ROLLOUT):
            if self.selected(Phase.ROLLOUT):
                lengths = (
                    self.last_lengths or [cfg.rollout.max_context] * cfg.batch.samples_per_step
                )
                trajs, source = self._select(
                    Phase.ROLLOUT,
                    (prompts, agent),
                    lengths,
                    lambda data, layout: self.rollout(*data, layout),
                    self.backend.switch,
                    selected,
                )
            elif cfg.rollout.mode == "async":
                trajs, source, groups = self._async_rollout()
            else:
                trajs, source = self.rollout(prompts, agent)
            drawn = trajs  # every trajectory generated (the rollout metrics cover them)
            if self.sampler is not None:
                drawn, trajs, sampling = self.sampler.fill(
                    self.step,
                    Rollout(trajs, source),
                    lambda more: self._extra_rollout(more, agent),
                    self._skip_floor(),
                )
                self.sampling_metrics = sampling.metrics()

        ok = [t for t in trajs if t.ok]
        if self._too_few(trajs, ok):
            return self._skipped_step(drawn, clock, start, selected)
        self.empty_steps = 0
        with clock(Phase.EXPERIENCE), self.heartbeat.activity(Activity.EXPERIENCE):
            if cfg.rollout.mode != "async":
                groups = group_index(ok)
            batch = (
                trajectories_to_batch(
                    ok, source * SAMPLE_ID_STRIDE, groups, self.estimator, self._routes
                )
                if source is not None
                else schema_batch(routes=self._routes)
            )
            rolled = batch
            batch, skipped = skip_zero_advantage(batch, self.skip_rule, self._skip_floor())
            lengths = gathered_lengths(rolled.lengths) if self.selection is not None else []
            self.last_lengths = lengths or self.last_lengths  # the rollout's: every sample
            if lengths and skipped.num_samples:
                lengths = gathered_lengths(batch.lengths)
            if self.selected(Phase.EXPERIENCE) and lengths:
                batch = self._select(
                    Phase.EXPERIENCE, batch, lengths, self.experience, self.prepare, selected
                )
                selected["selector/experience/samples"] = float(len(lengths))
            else:
                batch = self.experience(batch, self.active[Phase.EXPERIENCE])

        with clock(Phase.TRAIN), self.heartbeat.activity(Activity.TRAIN):
            if self.selected(Phase.TRAIN) and lengths:
                progress = TrainProgress()
                train_metrics = self._select(
                    Phase.TRAIN,
                    batch,
                    lengths,
                    lambda data, layout: self.train(data, layout, progress, skipped=skipped),
                    self.move_master,
                    selected,
                )
            else:
                train_metrics = self.train(batch, skipped=skipped)
        self.step += 1
        if self.selection is not None:
            self.release_unused()
        # advantage statistics over every sample; without a skip, the experience phase's
        # old log-probs (when it computed them) give the log-prob mismatch
        shown = rolled if skipped.num_samples else batch
        train_metrics = {
            **train_metrics,
            "num_skipped_samples": float(skipped.num_samples),
            "num_skipped_tokens": float(skipped.num_tokens),
        }
        return self._step_metrics(drawn, shown, train_metrics, clock, start, selected)

    def _extra_rollout(self, prompts: PromptSet, agent: AgentLoopConfig) -> Rollout:
        """An extra round of dynamic sampling in the layout the step's rollout ran in; the sync
        it may cost adds to the step's ``sync_stats``. Every rank calls."""
        before = self.sync_stats
        rolled = self.rollout(prompts, agent, self.active[Phase.ROLLOUT])
        after = self.sync_stats
        self.sync_stats = {k: before.get(k, 0.0) + after.get(k, 0.0) for k in before | after}
        return rolled

    def _step_metrics(self, trajs, batch, train_metrics, clock, start, selected):
        """The metrics of a step (every rank calls: the rollout statistics are all-reduced)."""
        cfg = self.config
        train_metrics = dict(train_metrics)
        train_mismatch = train_metrics.pop("logprob_mismatch", 0.0)
        metrics: dict[str, float | str] = {f"train/{k}": v for k, v in train_metrics.items()}
        metrics.update(rollout_metrics(trajs, batch, cfg.rollout.max_turns, train_mismatch))
        metrics["rollout/empty_steps"] = float(self.empty_steps)
        engine_stats = self.backend.rollout_stats()
        if self.taken is not None:
            engine_stats.update(async_metrics(self.producer, self.taken, cfg.rollout.max_staleness))
        if engine_stats:
            counts = torch.tensor(list(engine_stats.values()), dtype=torch.float64)
            dist.all_reduce(counts, group=host_group())
            metrics.update({f"rollout/{k}": float(v) for k, v in zip(engine_stats, counts)})
        metrics.update({f"time/{k}": v for k, v in clock.wall.items()})
        metrics.update({f"time_busy/{k}": v for k, v in clock.min_busy().items()})
        metrics["time/step"] = time.perf_counter() - start
        metrics.update({f"layout/{p}": str(lay) for p, lay in self.active.items()})
        metrics.update(selected)
        metrics.update(self.sampling_metrics)
        metrics.update({f"sync/{k}": v for k, v in self.sync_stats.items()})
        metrics.update(self.routing_metrics())
        metrics["weight_version"] = float(self.policy.version)
        metrics["tokens_per_s"] = metrics["rollout/tokens"] / max(metrics["time/step"], 1e-9)
        return metrics

    def _too_few(self, trajs: Sequence[Trajectory], ok: Sequence[Trajectory]) -> bool:
        """Whether the step has fewer usable (OK) trajectories over all ranks than its consuming
        layouts need (``_samples_needed``: e.g. every trajectory failed).
        Every rank calls (one all-reduce on the host world group), so all agree on a skip."""
        counts = torch.tensor([len(ok)], dtype=torch.int64)
        dist.all_reduce(counts, group=host_group())
        self.usable = int(counts[0])
        return self.usable < self._samples_needed()

    def _skip_floor(self) -> int:
        """Samples the zero-advantage skip keeps at least: ``_samples_needed``, and for a phase
        the selector picks this step, its widest candidate layout's needs."""
        needed = self._samples_needed()
        if self.selection is None:
            return needed
        for phase in (Phase.EXPERIENCE, Phase.TRAIN):
            if self.selected(phase):
                widest = max(c.dp for c in self.selection.selectors[phase].candidates)
                per_rank = self.config.batch.num_mini_batches if phase == Phase.TRAIN else 1
                needed = max(needed, widest * per_rank)
        return needed

    def _samples_needed(self) -> int:
        """Samples the step needs at least: every DP rank of the train layout one per
        mini-batch, every DP rank of the experience layout one (the layouts the phases last ran
        in; a layout the selector moves to this step is not known yet)."""
        needed = self.active[Phase.TRAIN].dp * self.config.batch.num_mini_batches
        if self.experience_work():
            needed = max(needed, self.active[Phase.EXPERIENCE].dp)
        return needed

    def _skipped_step(self, trajs, clock: BusyClock, start: float, selected: dict) -> dict:
        """Skip a step without enough usable trajectories: no experience or train phase, the
        weights unchanged, a warning naming the most common failure reasons over all ranks;
        past ``rollout.max_empty_steps`` such steps in a row, raise ``EmptyStepsError`` naming
        them. Every rank calls (the same decision everywhere: ``_too_few``)."""
        self.empty_steps += 1
        limit = self.config.rollout.max_empty_steps
        causes = failure_causes(trajs)
        step = self.step
        what = (
            f"step {step}: {self.usable} usable trajectories of {causes.total} (the "
            f"experience/train layouts need >= {self._samples_needed()}: one per data-parallel "
            f"rank and mini-batch); failures: {causes.text}"
        )
        if self.empty_steps > limit:
            raise EmptyStepsError(
                f"{what}; {self.empty_steps} such steps in a row exceed rollout.max_empty_steps="
                f"{limit}: stopping the run (fix the cause, or raise the limit)"
            )
        warnings.warn(
            f"{what}; step skipped (weights unchanged), {self.empty_steps} of at most {limit} "
            "in a row (rollout.max_empty_steps)",
            EmptyStepWarning,
            stacklevel=2,
        )
        self.step += 1
        return self._step_metrics(
            trajs, schema_batch(routes=self._routes), {}, clock, start, selected
        )

    def _async_rollout(self) -> tuple[list[Trajectory], int, dict[str, int]]:
        """``rollout.mode: async``: start this rank's producer (first step), push the weights
        if the engines are behind (the producer holds new starts meanwhile; ``restart``
        cancels its unfinished trajectories first), let it admit this step's groups, and take
        this rank's quota of finished ones (``orchestration.async_rollout``). Every rank calls."""
        cfg = self.config
        if self.producer is None:
            self.producer = self._build_producer()
            self.producer.start()
        layout = self.active[Phase.ROLLOUT]
        if self.backend.version != self.policy.version:
            self.producer.begin_update()
            self.sync_stats = self.backend.sync_weights(layout)
        self.producer.end_update(self.policy.version, self.step)
        timeout = cfg.rollout.async_take_timeout_s
        self.taken = self.producer.take(self.step, timeout_s=timeout)
        rank = dist.get_rank()
        return self.taken.trajectories, rank, group_ids(self.taken.groups, self.producer.plan)

    def _build_producer(self) -> AsyncProducer:
        cfg = self.config
        ds = cfg.rollout.dynamic_sampling
        plan = GroupPlan(
            cfg.batch.prompts_per_step,
            dist.get_rank(),
            dist.get_world_size(),
            max_staleness=cfg.rollout.max_staleness,
            max_buffered_groups=cfg.rollout.max_buffered_groups,
            seed=cfg.seed,
            first_step=self.step,  # a resumed run goes on with its step's prompts
            max_dropped_per_step=ds.extra_prompt_cap(cfg.batch.prompts_per_step)
            if ds.enabled
            else 0,
        )
        # the per-group sampling seed replaces this config's (GroupPlan.sampling_seed)
        agent = agent_config(
            cfg,
            group_size=cfg.batch.samples_per_prompt,
            temperature=cfg.rollout.sampling.temperature,
            seed=cfg.seed,
        )
        backend = self.backend

        async def close(pool) -> None:
            await pool.close()

        placement = None
        if cfg.rollout.repack.enabled:
            rank = dist.get_rank()

            def placement(pool) -> Placement:
                return Placement(
                    pool,
                    cfg.rollout.sglang.engine_relays,
                    cfg.rollout.repack,
                    holder=f"rank{rank}",
                    timeline=cfg.run_dir / f"repack_rank{rank}.jsonl",
                )

        return AsyncProducer(
            plan,
            cfg.env.spec(),
            lambda engine: AgentLoop(engine, self.tokenizer, agent, remote_rewards(cfg.reward)),
            backend.generation_pool,
            close,
            group_size=cfg.batch.samples_per_prompt,
            partial_rollout=cfg.rollout.partial_rollout,
            placement=placement,
            judge=(ds.metric, ds.tolerance) if ds.enabled else None,
        )

    def stop_async(self) -> None:
        """Stop this rank's producer (end of the run, before the final evaluation) and check
        that no group was lost or used twice. Local."""
        if self.producer is not None:
            self.producer.stop()
            self.producer.check_accounting()
            self.producer = None

    def _select(self, phase, data, lengths, phase_fn, switch, metrics):
        """Run ``phase`` in the selector's layout (with OOM recovery); records the layout it ran
        in and the decision's metrics. Every rank calls."""
        result, self.active[phase], decided = self.selection.run(
            phase,
            data,
            lengths,
            phase_fn,
            switch=switch,
            static_bytes=self.resident_bytes,
            train_layout=lambda: self.policy.train_layout,
            step=self.step,
        )
        metrics.update(decided)
        return result

    def evaluate(
        self, num_prompts: int, seed_offset: int, samples: int, temperature: float
    ) -> dict[str, float]:
        """Success rate on held-out prompts (every rank; the same result everywhere)."""
        prompts = PromptSet(
            self.config.env.spec(), tuple(range(seed_offset, seed_offset + num_prompts)), "eval"
        )
        agent = agent_config(
            self.config, group_size=samples, temperature=temperature, seed=seed_offset, train=False
        )
        trajs, _ = self.rollout(prompts, agent)
        stats = torch.tensor(
            [len(trajs), sum(t.reward >= 1.0 for t in trajs if t.ok), sum(t.reward for t in trajs)],
            dtype=torch.float64,
            device="cpu",
        )
        dist.all_reduce(stats, group=host_group())
        use_layout(self.policy.train_layout)
        n = max(float(stats[0]), 1.0)
        return {
            "eval/success_rate": float(stats[1]) / n,
            "eval/reward": float(stats[2]) / n,
            "eval/trajectories": float(stats[0]),
        }


class EmptyStepsError(RuntimeError):
    """More steps in a row than ``rollout.max_empty_steps`` had no usable trajectories; the
    message names the most common failure reasons (the same on every rank)."""


class EmptyStepWarning(UserWarning):
    """A step was skipped: too few usable trajectories (the message names the failures)."""


@dataclass(frozen=True)
class FailureCauses:
    total: int
    """Trajectories of the step over all ranks."""
    text: str
    """The most common failure reasons with counts and an example error each."""


MAX_CAUSES = 3
"""Failure reasons named in an empty step's warning or error."""


def failure_causes(trajs: Sequence[Trajectory]) -> FailureCauses:
    """The step's failure reasons over all ranks, most common first, each with its count and
    one example error (first rank's first). Every rank calls (an object all-gather on the host
    world group)."""
    local: dict[str, list] = {}
    for t in trajs:
        if not t.ok:
            entry = local.setdefault(t.end_reason.value, [0, t.error or ""])
            entry[0] += 1
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (len(trajs), local), group=host_group())
    total, merged = 0, {}
    for n, per_rank in gathered:
        total += n
        for reason, (count, example) in per_rank.items():
            entry = merged.setdefault(reason, [0, example])
            entry[0] += count
    ranked = sorted(merged.items(), key=lambda kv: (-kv[1][0], kv[0]))
    parts = [f"{r} x{c} (e.g. {e[:200]!r})" for r, (c, e) in ranked[:MAX_CAUSES]]
    if len(ranked) > MAX_CAUSES:
        parts.append(f"{len(ranked) - MAX_CAUSES} other reasons")
    return FailureCauses(total, ", ".join(parts) or "none (no trajectory failed)")


def every_stage(layout: ParallelLayout, phase: str, fields: tuple[str, ...]) -> Destination:
    """Dispatch destination for the train step / log-prob pass: whole samples on every rank of a
    replica (CP folded into TP, ``replica_layout``) and ``fields`` on every pipeline stage, since
    every stage runs the same dispatched micro-batches (the last also reads the rest)."""
    return Destination(
        replica_layout(layout), phase, first_stage_fields=fields, middle_stage_fields=fields
    )


@dataclass
class TrainProgress:
    """Mini-batches of one step's train phase already applied (survives an OOM re-run)."""

    done: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class _NoUpdate:
    """An optimizer whose ``step`` applies nothing (start-up profiling of the train phase)."""

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer

    def step(self):
        return True, None, None

    def __getattr__(self, name: str):
        return getattr(self._optimizer, name)


def check_engine_relays(relays: Sequence[str]) -> None:
    """``rollout.repack``: every engine relay waits for one release per trainer process
    (``--release-holders`` = the world size). Rank 0 asks the relays and broadcasts what they
    said, so every rank raises the same ``ValueError`` (naming each relay that is wrong or did
    not answer) or none does. Collective: every rank of the world (host group)."""
    answers = [relay_holders(relays) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(answers, src=0, group=host_group())
    problems = release_holder_problems(answers[0], dist.get_world_size())
    if problems:
        raise ValueError("rollout.repack: " + "; ".join(problems))


def _unrouted(micro_batch: dict[str, object]) -> dict[str, object]:
    """A micro-batch without its routing action (its forward routes natively)."""
    return {k: v for k, v in micro_batch.items() if k != "routing"}
