"""``rollout.engine: embedded``: the Megatron model itself generates, in the rollout layout, in
the trainer's own processes.

- Engines: one ``EmbeddedEngine`` per rollout layout, over the policy's copy in that layout
  (the master chunks when it is the train layout), built the first time the layout is used (the
  start-up layout eagerly, the selector's choices lazily) and cached; ``retain`` and
  ``master_moved`` drop the ones whose chunks are gone.
- Weights: ``sync_weights`` reshards the master weights into the layout's copy point to point
  when it is stale (``Policy.sync``) and tags the engine with the weight version.
- Rollout: each DP replica of the rollout layout drives its share of the prompts (prompt i ->
  replica i % dp) through the agent loop; TP rank 0 of the replica schedules, its TP peers
  compute with it (``run_engine``). Trajectories stay on TP rank 0 of each replica (a group's
  trajectories on one rank: GRPO baselines are computed there); the replica index is the source.

The embedded engine generates with tp and dp only: the rollout layout needs pp = cp = 1
(``problems``).

Which ranks call: every rank of the world.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_earl import runtime
from megatron_earl.config.embedded import COMPILE_SWITCHES, MAX_ENGINE_ROWS
from megatron_earl.config.run import RunConfig
from megatron_earl.config.vocab import EngineKind, Phase
from megatron_earl.orchestration.engines.base import (
    Rollout,
    RolloutBackend,
    register_rollout_backend,
)
from megatron_earl.orchestration.rollout import PromptSet
from megatron_earl.parallel.ddp import unwrap_chunk
from megatron_earl.parallel.layout import ParallelLayout, phase_layout
from megatron_earl.parallel.state import use_layout
from megatron_earl.rewards.base import WeightedReward
from megatron_earl.rewards.service import remote_rewards
from megatron_earl.rollout.agent.loop import AgentLoop, AgentLoopConfig, RolloutBatch
from megatron_earl.rollout.agent.trajectory import Trajectory
from megatron_earl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, run_engine
from megatron_earl.selector.footprint import kv_sizing
from megatron_earl.tokenizer.base import ChatTokenizer


def device_memory_bytes() -> int | None:
    """This rank's compute device's memory (CUDA), or None where there is no figure (the CPU,
    the emulated device)."""
    device = runtime.policy().device
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def engine_config(
    config: RunConfig, layout: ParallelLayout, device_bytes: float | None = None
) -> EmbeddedEngineConfig:
    """The engine settings of ``layout``'s engine: KV rows for ``rollout.max_concurrency`` (at
    most ``MAX_ENGINE_ROWS``), fewer when its memory budget holds fewer
    (``selector.footprint.kv_sizing``: ``rollout.embedded.kv_cache_mb``, or
    ``kv_memory_fraction`` x ``device_bytes`` less the weights and train state the memory model
    predicts; no budget without a memory figure), ``rollout.max_context`` per row (the whole
    cache is allocated when the engine is built: the selector counts it,
    ``orchestration.selection``),
    ``rollout.embedded``'s threads, and the compiled decode and prefill steps when asked for and
    ``layout`` has tp = 1 (else eager); routes recorded when ``routing`` asks for them. Steps
    run in the engine's worker thread (``EmbeddedEngineConfig.step_thread``): the agent loops'
    env and reward timeouts keep running during a long step. Pure."""
    rollout = config.rollout
    return EmbeddedEngineConfig(
        max_batch_size=min(rollout.max_concurrency, MAX_ENGINE_ROWS),
        kv_cache_bytes=kv_sizing(config, device_bytes, layout).budget_bytes,
        max_seq_len=rollout.max_context,
        seed=config.seed,
        decode_threads=rollout.embedded.decode_threads,
        compile_decode=rollout.embedded.compile_decode and layout.tp == 1,
        compile_prefill=rollout.embedded.compile_prefill and layout.tp == 1,
        record_routes=config.routing.records,
    )


@register_rollout_backend
class EmbeddedBackend(RolloutBackend):
    """Embedded engines over the policy's copies in the rollout layouts (module docstring)."""

    name = EngineKind.EMBEDDED

    def __init__(self, config, policy, tokenizer) -> None:
        super().__init__(config, policy, tokenizer)
        self.engines: dict[ParallelLayout, EmbeddedEngine] = {}
        self.switch(phase_layout(config.layouts, Phase.ROLLOUT))

    def switch(self, layout: ParallelLayout) -> None:
        """Activate ``layout``; build the policy's copy there and its engine if needed."""
        self._engine(layout)

    def _engine(self, layout: ParallelLayout) -> EmbeddedEngine:
        """The engine over the policy's chunks in ``layout`` (built once, cached). Activates
        ``layout``. Every rank calls."""
        use_layout(layout)
        if layout not in self.engines:
            self.policy.ensure(layout)
            settings = engine_config(self.config, layout, device_memory_bytes())
            asked = self.config.rollout.embedded
            for name in COMPILE_SWITCHES:
                if getattr(asked, name) and not getattr(settings, name) and dist.get_rank() == 0:
                    print(
                        f"rollout.embedded.{name}: the engine of {layout} runs eagerly "
                        "(compiled steps need tp = 1)",
                        flush=True,
                    )
            self.engines[layout] = EmbeddedEngine(
                [unwrap_chunk(c) for c in self.policy.chunks(layout)],
                self.config.model,
                settings,
                detokenize=self.tokenizer.decode,
            )
        return self.engines[layout]

    def sync_weights(self, layout: ParallelLayout) -> dict[str, float]:
        """Reshard the master weights into ``layout``'s copy if stale (``reshard_s``,
        ``reshard_bytes_sent``); tag the engine with the version. Collective (world)."""
        engine = self._engine(layout)
        stats = self.policy.sync(layout)
        engine.mark_weights_updated(self.policy.version)
        return stats

    def generate(self, prompts: PromptSet, agent: AgentLoopConfig, layout: ParallelLayout):
        engine = self._engine(layout)
        engine.model.eval()
        rewards = remote_rewards(self.config.reward)
        result = run_rollout(engine, self.tokenizer, prompts, agent, rewards)
        for chunk in self.policy.ddp_chunks:  # the engine may run on the master chunks
            chunk.train()
        source = parallel_state.get_data_parallel_rank() if result.is_source else None
        return Rollout(result.trajectories, source)

    def master_moved(self, old: ParallelLayout, new: ParallelLayout) -> None:
        """The engines over the old master's chunks and over ``new``'s dropped copy go (rebuilt
        on demand)."""
        self.engines.pop(old, None)
        self.engines.pop(new, None)

    def retain(self, layouts: Iterable[ParallelLayout]) -> None:
        keep = set(layouts)
        for layout in [lay for lay in self.engines if lay not in keep]:
            del self.engines[layout]


@dataclass
class RolloutResult:
    """What this rank holds after the rollout: trajectories on TP rank 0 of a replica, none else."""

    trajectories: list[Trajectory] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    is_source: bool = False
    """True on the ranks that hold trajectories (TP rank 0 of each rollout replica)."""


def run_rollout(
    engine: EmbeddedEngine,
    tokenizer: ChatTokenizer,
    prompts: PromptSet,
    config: AgentLoopConfig,
    reward_fns: Sequence[WeightedReward] = (),
) -> RolloutResult:
    """Roll out this replica's prompts (``config.group_size`` samples each) on ``engine``. Every
    rank of the world calls, with the rollout layout active."""
    replica = parallel_state.get_data_parallel_rank()
    num_replicas = parallel_state.get_data_parallel_world_size()
    tasks = prompts.tasks_for(replica, num_replicas)

    async def driver(eng: EmbeddedEngine) -> RolloutBatch:
        return await AgentLoop(eng, tokenizer, config, reward_fns).run_batch(tasks)

    batch = run_engine(engine, driver)
    if batch is None:
        return RolloutResult()
    return RolloutResult(batch.trajectories, batch.metrics.to_dict(), is_source=True)
