"""``megatron-earl serve --tp-size N``: one model served by N processes (SGLang's TP in one server).

    megatron-earl serve --tp-size 2 --model-config model.json --model-path full.pt --port 30000

The serve process is TP rank 0: the scheduler of the embedded engine and the HTTP server. Before
anything else it binds the world's rendezvous store on a port the OS picks
(``runtime.host_rendezvous``) and starts N-1 followers (``python -m
megatron_earl.rollout.serve.follower <the same arguments>``) with ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT`` of that store, and all N form one world (gloo on CPU; on GPUs
the device groups are NCCL, one device per rank: ``LOCAL_RANK`` = TP rank). Every rank then
builds the model the way a TP1 server does -- ``ParallelLayout(dp=N)``, seeded random weights or
the ``--model-path`` full state -- takes its full state, builds the model again in
``ParallelLayout(tp=N)`` and loads its shard from that state (``to_tp_layout``): the served
weights equal a TP1 server's, bit for bit.
Followers run ``EmbeddedEngine.follow()``: they execute the steps rank 0 broadcasts (forwards,
weight loads, ``call``s) and exit when rank 0 shuts the engine down.

Lifetime (``Followers``): followers ignore SIGINT and SIGTERM (a launcher's ``killpg`` reaches the
whole process group; rank 0 handles the signal and stops them with the engine); they die with
rank 0 however it ends (``PR_SET_PDEATHSIG``: SIGKILL when rank 0 dies, even by SIGKILL; and a
pipe they watch, closed when rank 0 exits). A follower that exits while rank 0 serves ends the
server (exit code 1, the other followers killed), as SGLang ends a server whose TP worker died.

Weight updates: ``update_weights_from_tensor`` / ``_from_disk`` apply to the full state gathered
from every rank (``EmbeddedEngine.state_dict``) and load it on every rank (one "load" step).
``update_weights_from_tensor`` takes a list of N identical payloads (SGLang: one per TP rank; the
trainer sends ``rollout.sglang.engine_tp`` copies). SGLang's distributed protocol: every TP rank
joins the trainer's group as ``rank_offset + tp_rank`` and receives each bucket (``TPGroup``),
so the trainer's ``rollout.sglang.engine_tp`` must be N; joins and receives run as engine steps
(generation waits meanwhile, as in SGLang, whose scheduler handles them in its loop); rank 0
applies what it received and loads it on every rank as above.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megatron_earl.config.model import ModelConfig

if TYPE_CHECKING:
    from megatron_earl.rollout.embedded.engine import EmbeddedEngine

PARENT_ENV = "MEGATRON_EARL_SERVE_PARENT"
"""Set in a follower's environment: the pid of its rank 0 (the serve process)."""
FOLLOWER_MODULE = "megatron_earl.rollout.serve.follower"
"""The followers' entry point (``python -m``); it imports this module, so the name is kept here."""


class Followers:
    """The N-1 follower processes of a ``serve --tp-size N`` (rank 0 is this process)."""

    def __init__(self, tp: int, argv: Sequence[str]) -> None:
        from megatron_earl.runtime import host_rendezvous

        self.stopping = False
        # Rank 0 binds the store before the followers learn its port: nothing can take it between.
        port, parent = str(host_rendezvous(tp)), str(os.getpid())
        world = {"WORLD_SIZE": str(tp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        os.environ.update(world, RANK="0", LOCAL_RANK="0")
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", FOLLOWER_MODULE, *argv],
                env=os.environ | world | {"RANK": str(r), "LOCAL_RANK": str(r), PARENT_ENV: parent},
                stdin=subprocess.PIPE,  # closed when this process ends: followers watch it
            )
            for r in range(1, tp)
        ]
        threading.Thread(target=self._watch, name="serve-tp-followers", daemon=True).start()

    def _watch(self) -> None:
        """A follower gone while serving ends the server: the engine cannot step without it
        (exit code 0 is a follower the engine's stop step released: the server is stopping)."""
        while not self.stopping:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() not in (None, 0) and not self.stopping:
                    print(
                        f"megatron-earl serve: TP rank {rank} (pid {proc.pid}) exited with code "
                        f"{proc.returncode}; stopping the server",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.kill()
                    os._exit(1)
            time.sleep(0.2)

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the followers to exit (after the engine's stop step),
        then kill the rest."""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def followers(tp: int, argv: Sequence[str]) -> Iterator[Followers | None]:
    """Start the followers of ``--tp-size tp`` (none for 1) and stop them on exit: after a clean
    shutdown they exit by themselves (10 s allowed), after an error they are killed."""
    if tp < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp}")
    if tp == 1:
        yield None
        return
    group = Followers(tp, argv)
    clean = False
    try:
        yield group
        clean = True
    finally:
        group.stop(10.0 if clean else 0.0)


def to_tp_layout(chunks: list[nn.Module], model: ModelConfig, tp: int, seed: int) -> list:
    """The model of ``chunks`` (built whole, in the layout ``dp=tp``) rebuilt in ``tp=tp`` with
    the same weights; ``chunks`` itself for tp 1. Every rank of the world calls it."""
    if tp == 1:
        return chunks
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import full_state_dict, load_full_state_dict

    full = full_state_dict(chunks, replicas=True)  # every rank holds the whole model
    del chunks
    use_layout(ParallelLayout(tp=tp))
    runtime.seed(seed)
    sharded = build_model(model)
    load_full_state_dict(sharded, full)
    return sharded


# ---------------------------------------------------------------------- the distributed protocol

_GROUPS: dict[str, Any] = {}
"""This rank's weight-update groups by name (every TP rank of a tp > 1 server)."""


def _join_rank(
    engine: EmbeddedEngine,
    *,
    address: str,
    port: int,
    rank_offset: int,
    world_size: int,
    name: str,
    backend: str,
    timeout_s: float,
) -> None:
    from megatron.core import parallel_state

    from megatron_earl.rollout.weights.group import join_weight_update_group

    _drop_rank(engine, name)
    rank = rank_offset + parallel_state.get_tensor_model_parallel_rank()
    _GROUPS[name] = join_weight_update_group(
        address, port, rank, world_size, name, backend, timeout_s
    )


def _receive_rank(
    engine: EmbeddedEngine,
    name: str,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    load_format: str | None,
) -> list | None:
    from megatron_earl.rollout.weights.group import receive_bucket

    try:
        received = receive_bucket(_GROUPS[name], names, dtypes, shapes, load_format)
    except Exception:
        _drop_rank(engine, name)
        raise
    return received if engine.is_scheduler else None  # rank 0 applies and loads it everywhere


def _drop_rank(engine: EmbeddedEngine, name: str) -> None:
    group = _GROUPS.pop(name, None)
    if group is not None:
        group.shutdown()


class TPGroup:
    """A weight-update group joined by every TP rank of the engine (rank 0's handle)."""

    def __init__(self, engine: EmbeddedEngine, name: str) -> None:
        self.engine, self.name = engine, name

    @classmethod
    async def join(
        cls,
        engine: EmbeddedEngine,
        address: str,
        port: int,
        rank_offset: int,
        world_size: int,
        name: str,
        backend: str,
        timeout_s: float,
    ) -> TPGroup:
        """Every TP rank joins (``weights.group.join_weight_update_group`` with rank
        ``rank_offset + tp_rank``); on any failure none keeps the group."""
        join = functools.partial(
            _join_rank,
            address=address,
            port=port,
            rank_offset=rank_offset,
            world_size=world_size,
            name=name,
            backend=backend,
            timeout_s=timeout_s,
        )
        try:
            await engine.call(join)
        except RuntimeError:
            await engine.call(functools.partial(_drop_rank, name=name))
            raise
        return cls(engine, name)

    async def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        load_format: str | None,
    ) -> list:
        """Every TP rank receives the bucket; rank 0's tensors are returned."""
        part = functools.partial(
            _receive_rank,
            name=self.name,
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            load_format=load_format,
        )
        return (await self.engine.call(part))[0]

    async def shutdown(self) -> None:
        await self.engine.call(functools.partial(_drop_rank, name=self.name))
