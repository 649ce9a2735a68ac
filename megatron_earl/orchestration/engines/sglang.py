"""``rollout.engine: sglang``: SGLang engines that are servers of their own (other nodes, or
``megatron-earl serve`` for tests), given by ``rollout.engine_urls`` and driven over SGLang's
native HTTP API: the disaggregated setup. The job holds no rollout copy of the policy
(``policy_layouts`` drops the rollout layout).

- Rollout: every trainer rank drives its share of the prompts (prompt i -> rank i % world) through
  the agent loop over one ``EnginePool`` of all engines (least-loaded routing, a trajectory sticks
  to one engine, a failed engine's requests move to another). Trajectories stay on the rank that
  drove them (the dispatcher's sources; the rank is the source index).
- Weights: before a rollout whose engines serve an older version, the master weights are
  resharded onto rank 0 one bucket at a time (``staged_weights``: the same point-to-point
  planner as any reshard, into destination pieces of one layer of a key, or a whole
  non-layer tensor, at most ``rollout.sglang.bucket_bytes`` together; pinned host memory on
  CUDA, or the GPU for NCCL broadcasts; rank 0 never holds the whole model) and pushed, bucket
  after bucket, by the transport
  ``rollout.sglang.weight_update`` chooses (``rollout.weights.transports``: ``tensor``,
  ``disk`` or ``distributed``; each pause -> flush -> update -> continue, then the engines'
  version is read back). Rank 0 keeps the transport for the run (the distributed one keeps its
  process group with the engines until ``close``).
- Colocation (``rollout.sglang.colocated``: the engines share the trainer's GPUs), in SGLang
  users' order (slime's): after every rollout, once every rank is done, rank 0 releases every
  engine's memory (``release_memory_occupation``, all tags) and the ranks go on to train; the
  next sync resumes ``weights`` on every engine, pushes the weights (always: an SGLang engine
  without ``--enable-weights-cpu-backup`` does not keep their values), then resumes
  ``kv_cache`` and ``cuda_graph``. ``close`` resumes engines left released.

The rollout layout cannot be selected per step with these engines (``problems``).

Which ranks call: every rank of the world.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_earl import runtime
from megatron_earl.compat import event_loop
from megatron_earl.config.model import ModelConfig
from megatron_earl.config.vocab import EngineKind, MemoryTag, Phase, WeightUpdate
from megatron_earl.convert.engine_model import token_ids_config
from megatron_earl.convert.mapping import LAYER_PREFIX
from megatron_earl.models.hf_mapping import global_shapes, megatron_to_hf
from megatron_earl.orchestration.engines.base import (
    Rollout,
    RolloutBackend,
    register_rollout_backend,
)
from megatron_earl.orchestration.rollout import PromptSet
from megatron_earl.parallel.groups import host_group
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.parallel.state import use_layout
from megatron_earl.redistribute.geometry import ShardPiece
from megatron_earl.redistribute.plan_cache import PlanCache
from megatron_earl.redistribute.weight_exec import reshard_weights
from megatron_earl.rewards.service import remote_rewards
from megatron_earl.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_earl.rollout.agent.trajectory import Trajectory
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.pool import EnginePool, PoolConfig
from megatron_earl.rollout.sglang.startup import engines_at_start
from megatron_earl.rollout.weights.relay.publisher import wait_for_engines
from megatron_earl.rollout.weights.sync import NamedTensor, plan_buckets
from megatron_earl.rollout.weights.transports import WeightTransport, build_transport

log = logging.getLogger("megatron_earl.orchestration.engines.sglang")


@dataclass(frozen=True)
class StagedPart:
    """Global tensor ``key`` (rank 0's copy), whole, or for a decoder key the layers
    ``first_layer .. first_layer + tensor.size(0) - 1`` of its layer stack."""

    key: str
    first_layer: int
    tensor: torch.Tensor

    def hf_named(self, model: ModelConfig) -> Iterator[NamedTensor]:
        """Its HF-named tensors (``megatron_to_hf``)."""
        return megatron_to_hf(self.key, self.tensor, model, self.first_layer)


def staged_weights(
    master_pieces: list[ShardPiece],
    model: ModelConfig,
    dtype: torch.dtype,
    bucket_bytes: int,
    *,
    device: torch.device | None = None,
    caches: dict[int, PlanCache] | None = None,
) -> Iterator[list[StagedPart]]:
    """The whole model as consecutive buckets of ``StagedPart`` on rank 0 (empty lists
    elsewhere), each resharded point to point from the master pieces when it is asked for.
    Collective over the world: every rank iterates it to the end, in step.

    A part is one layer of a decoder key (the global tensors stack every layer: one of them is
    a whole-model-sized share, GiBs at 7B) or a whole other tensor (embedding, final norm,
    output layer), layer after layer; a bucket holds parts of at most ``bucket_bytes`` together
    (``plan_buckets``; a larger part is a bucket alone), so rank 0 holds a bucket or two, never
    the model: the push sends a bucket and drops it while the next is resharded. Rank 0's parts
    land in ``device`` memory when given (a transport that sends from the GPU, e.g. NCCL
    broadcasts), else in host memory, pinned on CUDA (the reshard copies device buffers into
    it; freed pinned blocks are reused by torch's caching host allocator). ``caches``: a plan
    cache per bucket index, kept across pushes (bucket i's plan is reused while no rank's
    pieces changed; one cache per index, as a rank's own pieces may be the same for several
    buckets)."""
    shapes = global_shapes(model)
    size = torch.empty((), dtype=dtype).element_size()
    layer_keys = [k for k in shapes if k.startswith(LAYER_PREFIX)]
    units = [(k, layer) for layer in range(model.num_layers) for k in layer_keys]
    units += [(k, 0) for k in shapes if not k.startswith(LAYER_PREFIX)]

    def unit_shape(key: str, layer: int) -> tuple[int, ...]:
        return (1, *shapes[key][1:]) if key.startswith(LAYER_PREFIX) else tuple(shapes[key])

    plan = plan_buckets([math.prod(unit_shape(*u)) * size for u in units], bucket_bytes)
    by_key: dict[str, list[ShardPiece]] = {}
    for piece in master_pieces:
        by_key.setdefault(piece.key, []).append(piece)
    rank0 = dist.get_rank() == 0
    pin = device is None and runtime.policy().pin_memory
    where = device or torch.device("cpu")
    caches = {} if caches is None else caches
    for index, members in enumerate(plan):
        parts: list[StagedPart] = []
        pieces: list[ShardPiece] = []
        keys: list[str] = []
        for key, layer in (units[i] for i in members):
            if key not in keys:
                keys.append(key)
            if not rank0:
                continue
            shape = unit_shape(key, layer)
            local = torch.empty(shape, dtype=dtype, device=where, pin_memory=pin)
            first = ((layer, layer + 1),) if key.startswith(LAYER_PREFIX) else ((0, shape[0]),)
            region = first + tuple((0, n) for n in shape[1:])
            parts.append(StagedPart(key, layer, local))
            pieces.append(
                ShardPiece(
                    key=key,
                    global_shape=tuple(shapes[key]),
                    region=region,
                    local=local,
                    param_name=f"{key}[{layer}]",
                    param=local,
                    is_replica=False,
                )
            )
        sources = [p for key in keys for p in by_key.get(key, ())]
        cache = caches.setdefault(index, PlanCache(max_entries=2))
        reshard_weights(sources, pieces, cache=cache)
        yield parts


def drain(buckets: Iterator) -> None:
    """Run a collective generator (``staged_weights``) to its end: the reshards a consumer did
    not ask for still meet their peers."""
    for _ in buckets:
        pass


@register_rollout_backend
class SGLangBackend(RolloutBackend):
    """The run's SGLang engines, as seen from every trainer rank (module docstring)."""

    name = EngineKind.SGLANG

    def __init__(self, config, policy, tokenizer) -> None:
        super().__init__(config, policy, tokenizer)
        self.urls = config.rollout.engine_urls
        self.version: int | None = None
        """Weight version the engines serve (None: never pushed by this run)."""
        self.transport: WeightTransport | None = None
        """Rank 0's weight transport (built at the first push)."""
        self.stats: dict[str, float] = {"engine_retries": 0.0, "engine_failovers": 0.0}
        """This rank's engine retries and failovers in the last rollout (colocated: and the
        memory release after it)."""
        self.released = False
        """Colocated: the engines' memory is released (since the last rollout)."""
        self.engine_tp: int | None = None
        """The engines' TP size (read from them at start-up)."""
        self.plans: dict[int, PlanCache] = {}
        """The push's reshard plans, a cache per bucket (``staged_weights``): a repeated push
        replans nothing while the layouts stay."""
        asyncio.run(self._check_reachable())

    async def _check_reachable(self) -> None:
        """Every engine (and the router) answers ``/health`` now, or the run stops naming the
        ones that do not; every engine's identity is checked (``rollout.sglang.startup``), and
        the engines' TP size becomes ``rollout.sglang.engine_tp`` when it is unset -- before any
        weight is gathered or pushed. Every rank checks."""
        check = await engines_at_start(self.config)
        for warning in check.warnings:
            if dist.get_rank() == 0:
                log.warning("%s", warning)
        check.raise_problems()
        self.engine_tp = check.engine_tp

    @classmethod
    def policy_layouts(cls, layouts: dict[str, ParallelLayout]) -> dict[str, ParallelLayout]:
        """Every phase's but the rollout's: the engines hold their own weights."""
        return {phase: layout for phase, layout in layouts.items() if phase != Phase.ROLLOUT}

    def switch(self, layout: ParallelLayout) -> None:
        """The engines serve every layout alike; the weights are read from the master copy,
        so the train layout is activated."""
        use_layout(self.policy.train_layout)

    def master_moved(self, old: ParallelLayout, new: ParallelLayout) -> None:
        """Nothing is built over the master's chunks (the next push reads the new ones)."""

    def retain(self, layouts: Iterable[ParallelLayout]) -> None:
        """Nothing is built per layout."""

    def sync_weights(self, layout: ParallelLayout) -> dict[str, float]:
        """Push the master weights if the engines are behind or released (``weight_push_s``:
        gather and push; ``weight_transfer_s``: the push; ``weight_push_bytes``: tensor bytes
        each engine received, or written to disk; ``weight_push_buckets``; colocated:
        ``memory_resume_weights_s`` and ``memory_resume_kv_cache_s``, the resumes around the
        push). Ends with the train layout active. Collective (world)."""
        self.switch(layout)
        version = self.policy.version
        if self.version == version:
            return {}
        start = time.perf_counter()
        rank0 = dist.get_rank() == 0
        transport = self._transport() if rank0 else None
        buckets = staged_weights(
            self.policy.master_pieces,
            self.config.model,
            self.config.model.torch_dtype,
            self.config.rollout.sglang.bucket_bytes,
            device=transport.staging_device if transport is not None else None,
            caches=self.plans,
        )
        stats = {}
        try:
            if rank0:
                stats = asyncio.run(self._push(buckets, version))
        finally:
            drain(buckets)  # every rank: the buckets the push did not ask for (or all, peers)
        dist.barrier(group=host_group())
        self.version, self.released = version, False
        return {"weight_push_s": time.perf_counter() - start, **stats}

    def _transport(self) -> WeightTransport:
        """Rank 0's transport, built at the first push and kept for the run."""
        if self.transport is None:
            settings = dataclasses.replace(self.config.rollout.sglang, engine_tp=self.engine_tp)
            self.transport = build_transport(settings, self.config.model, self.config.run_dir)
            self.transport.hf_config = token_ids_config(self.tokenizer)
            if self.config.rollout.mode == "async":
                # requests are in flight during the push (SGLang's flush_cache refuses then);
                # the pause retracts or holds them and they continue under the new weights
                self.transport.sync = dataclasses.replace(self.transport.sync, flush_cache=False)
                self.transport.asynchronous = True
        return self.transport

    async def _push(self, buckets: Iterator[list[StagedPart]], version: int) -> dict:
        """Rank 0: the push of the staged buckets (colocated with released engines: resume
        ``weights`` before it and ``kv_cache`` + ``cuda_graph`` after it, each timed)."""
        clients = self._control_clients()
        out: dict[str, float] = {}
        try:
            if self.released:
                out["memory_resume_weights_s"] = await _resume(clients, [MemoryTag.WEIGHTS])
            model = self.config.model
            named = (pair for bucket in buckets for part in bucket for pair in part.hf_named(model))
            stats = await self.transport.push(clients, named, version)
            if self.released:
                tags = [MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH]
                out["memory_resume_kv_cache_s"] = await _resume(clients, tags)
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        return {
            "weight_transfer_s": stats.seconds,
            "weight_push_bytes": float(stats.bytes_sent),
            "weight_push_buckets": float(stats.num_buckets),
            **out,
        }

    def close(self) -> None:
        """Rank 0 resumes the engines' memory if this run left it released (the engines end
        as they started) and releases its transport (the distributed group on the engines).
        Every rank."""
        resume = self.released and dist.get_rank() == 0
        self.released = False
        if self.transport is None and not resume:
            return

        async def close(transport: WeightTransport | None) -> None:
            clients = self._control_clients()
            try:
                if resume:
                    await _resume(clients, None)
                if transport is not None:
                    await transport.close(clients)
            finally:
                await asyncio.gather(*(c.close() for c in clients))

        asyncio.run(close(self.transport))
        self.transport = None

    def _release_memory(self) -> float:
        """Colocated, after a rollout: once every rank is done, rank 0 releases every engine's
        memory (all tags) and the ranks wait for it, so training starts with the engines' GPU
        memory free. Returns rank 0's time (0 elsewhere). Collective (world)."""
        dist.barrier(group=host_group())
        seconds = 0.0
        if dist.get_rank() == 0:

            async def release() -> float:
                clients = self._control_clients()
                start = time.perf_counter()
                try:
                    await asyncio.gather(*(c.release_memory_occupation() for c in clients))
                finally:
                    await asyncio.gather(*(c.close() for c in clients))
                return time.perf_counter() - start

            seconds = asyncio.run(release())
        dist.barrier(group=host_group())
        self.released, self.version = True, None  # the next sync resumes and pushes
        return seconds

    def _control_clients(self) -> list[SGLangClient]:
        """One client per engine with the admin key (weight updates, pause/flush/continue)."""
        key = self.config.rollout.sglang.admin_api_key()
        return [SGLangClient(url, ClientConfig(api_key=key)) for url in self.urls]

    def generation_clients(self) -> list[SGLangClient]:
        """The router when one is configured, else every engine (the pool routes)."""
        sglang = self.config.rollout.sglang
        urls = [sglang.router_url] if sglang.router_url else self.urls
        return [SGLangClient(url, ClientConfig(api_key=sglang.api_key())) for url in urls]

    def generation_pool(self) -> EnginePool:
        """The generation clients as one pool with health checks running (call it inside the
        event loop that will use it; ``pool.close()`` stops them)."""
        interval = self.config.rollout.sglang.health_interval_s
        config = PoolConfig(health_interval_s=interval, health_timeout_s=interval)
        pool = EnginePool(self.generation_clients(), config)
        pool.start_health_checks()
        return pool

    def generate(self, prompts: PromptSet, agent: AgentLoopConfig, layout: ParallelLayout):
        """Run this rank's prompts on the pool (local: the HTTP traffic is this rank's own)."""
        rank = dist.get_rank()
        tasks = prompts.tasks_for(rank, dist.get_world_size())
        self.stats = {"engine_retries": 0.0, "engine_failovers": 0.0}

        async def run() -> list[Trajectory]:
            if self._engines_may_lag():
                await self._wait_for_engines()
            pool = self.generation_pool()
            clients = pool.engines
            try:
                rewards = remote_rewards(self.config.reward)
                batch = await AgentLoop(pool, self.tokenizer, agent, rewards).run_batch(tasks)
            finally:
                await pool.close()
                self.stats = {
                    "engine_retries": float(sum(c.retries for c in clients)),
                    "engine_failovers": float(pool.failovers),
                }
            return batch.trajectories

        trajectories = event_loop.run(run()) if tasks else []
        if self.config.rollout.sglang.colocated:
            self.stats["memory_release_s"] = self._release_memory()
        return Rollout(trajectories, rank)

    def _engines_may_lag(self) -> bool:
        """Asynchronous rollout with relays: a push returns before the engines load it."""
        sglang = self.config.rollout.sglang
        return self.config.rollout.mode == "async" and sglang.weight_update == WeightUpdate.RELAY

    async def _wait_for_engines(self) -> None:
        """Before an evaluation: every engine serves the pushed version (under
        ``rollout.repack`` the relays load an engine once the producers released it)."""
        clients = self._control_clients()
        timeout_s = self.config.rollout.sglang.relay_timeout_s
        try:
            await wait_for_engines(clients, self.version, timeout_s)
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    def rollout_stats(self) -> dict[str, float]:
        """This rank's retried requests (connection errors, timeouts, 502/503/504, a router's
        upstream failure) and requests moved to another engine, in the last rollout; colocated:
        the memory release after it (rank 0's time, 0 on the other ranks)."""
        return dict(self.stats)


async def _resume(clients: list[SGLangClient], tags: list[MemoryTag] | None) -> float:
    """Resume ``tags`` (None: all) on every engine; returns the seconds it took."""
    start = time.perf_counter()
    await asyncio.gather(*(c.resume_memory_occupation(tags) for c in clients))
    return time.perf_counter() - start
