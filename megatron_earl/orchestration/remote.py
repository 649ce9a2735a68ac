"""Rollouts on SGLang engines (``rollout.engine: sglang`` with ``rollout.engine_urls``): the
disaggregated setup, where the engines are servers of their own (other nodes, or
``megatron-earl serve`` for tests) driven over SGLang's native HTTP API.

- Rollout: every trainer rank drives its share of the prompts (prompt i -> rank i % world) through
  the agent loop over one ``EnginePool`` of all engines (least-loaded routing, a trajectory sticks
  to one engine, a failed engine's requests move to another). Trajectories stay on the rank that
  drove them (the dispatcher's sources).
- Weights: before a rollout whose engines serve an older version, the master weights are
  resharded onto rank 0 as whole tensors (the same point-to-point planner as any reshard, into
  full-size destination pieces; rank 0 holds the model once) and pushed in buckets
  (pause -> flush -> buckets via ``update_weights_from_tensor``, tagged with the version ->
  continue). Streaming over ``update_weights_from_distributed`` is in ``rollout.weight_sync``
  for setups that can open an NCCL group to the engines.

Which ranks call: every rank of the world.
"""

from __future__ import annotations

import asyncio
import time

import torch
import torch.distributed as dist

from megatron_earl.config.model import ModelConfig
from megatron_earl.models.hf_mapping import global_shapes
from megatron_earl.redistribute.geometry import ShardPiece
from megatron_earl.redistribute.weight_exec import reshard_weights
from megatron_earl.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_earl.rollout.agent.trajectory import Trajectory
from megatron_earl.rollout.pool import EnginePool
from megatron_earl.rollout.sglang_client import SGLangClient
from megatron_earl.rollout.weight_sync import hf_named_tensors, push_weights


def gather_full_weights(
    master_pieces: list[ShardPiece], model: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor] | None:
    """Whole global tensors on rank 0 (None elsewhere), resharded point to point from the
    master pieces. Collective over the world."""
    full: dict[str, torch.Tensor] = {}
    pieces: list[ShardPiece] = []
    if dist.get_rank() == 0:
        for key, shape in global_shapes(model).items():
            full[key] = torch.empty(shape, dtype=dtype)
            pieces.append(
                ShardPiece(
                    key=key,
                    global_shape=tuple(shape),
                    region=tuple((0, n) for n in shape),
                    local=full[key],
                    param_name=key,
                    param=full[key],
                    is_replica=False,
                )
            )
    reshard_weights(master_pieces, pieces)
    return full if dist.get_rank() == 0 else None


class RemoteEngines:
    """The run's SGLang engines, as seen from every trainer rank."""

    def __init__(self, urls: tuple[str, ...], model: ModelConfig) -> None:
        self.urls = urls
        self.model = model
        self.version: int | None = None
        """Weight version the engines serve (None: never pushed by this run)."""

    def sync(self, master_pieces: list[ShardPiece], version: int, dtype: torch.dtype) -> dict:
        """Push the master weights if the engines are behind. Collective over the world."""
        if self.version == version:
            return {}
        start = time.perf_counter()
        full = gather_full_weights(master_pieces, self.model, dtype)
        stats = {}
        if full is not None:
            stats = asyncio.run(self._push(full, version))
        dist.barrier()
        self.version = version
        return {"weight_push_s": time.perf_counter() - start, **stats}

    async def _push(self, full: dict[str, torch.Tensor], version: int) -> dict:
        clients = [SGLangClient(url) for url in self.urls]
        try:
            stats = await push_weights(clients, hf_named_tensors(full, self.model), version)
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        return {
            "weight_push_bytes": float(stats.bytes_sent),
            "weight_push_buckets": stats.num_buckets,
        }

    def rollout(self, tasks: list, tokenizer, config: AgentLoopConfig) -> list[Trajectory]:
        """Run this rank's tasks on the pool (local: the HTTP traffic is this rank's own)."""
        if not tasks:
            return []

        async def run() -> list[Trajectory]:
            pool = EnginePool([SGLangClient(url) for url in self.urls])
            try:
                batch = await AgentLoop(pool, tokenizer, config).run_batch(tasks)
            finally:
                await pool.close()
            return batch.trajectories

        return asyncio.run(run())
