"""Run a function on N local gloo processes: the one harness used by every distributed test and
the CPU benchmarks.

    results = run_distributed(body, world_size=2, timeout_s=120, args=(...))

``body(*args)`` runs in every rank after ``megatron_earl.runtime.initialize()`` (torch.distributed
joined, CPU patches applied). It must be a module-level function (it is pickled by reference).
Its return values (picklable) come back as a list indexed by rank.

Failure is fast: the first rank that raises is reported with its traceback and the other ranks are
killed at once; a rank that dies without reporting, or a run that exceeds ``timeout_s``, kills every
rank and raises. No test can hang.

The rendezvous port is a free port at launch, which another process may take before rank 0's store
binds it (the suite runs on two workers, each launching ranks and servers): when rank 0 reports
the port taken (``EADDRINUSE``) before ``body`` ran, every rank is stopped and the launch repeats
on a new port, up to ``PORT_ATTEMPTS`` times. Nothing of ``body`` ran in a repeated attempt.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_PRELOAD = ["torch", "megatron.core", "megatron_earl.runtime"]
_CTX: Any = None
PORT_ATTEMPTS = 3
"""Launches of one ``run_distributed`` call whose rendezvous port was taken (module docstring)."""


class DistributedTestError(RuntimeError):
    """A rank failed, died or timed out."""


class _PortTaken(Exception):
    """Rank 0 could not bind the rendezvous port: launch again on another."""


def _context() -> Any:
    # forkserver: children fork from a clean server that imported torch once and never ran an
    # OpenMP region (forking a process that has is unsafe), so start-up costs ~0.1 s, not ~5 s.
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def free_port() -> int:
    """A port free now on 127.0.0.1. Under pytest-xdist, worker k of n only returns ports p with
    (p // 2) % n == k, so two workers never pick the same one (halved: Linux gives ``bind``'s
    automatic ports one parity and ``connect``'s the other, so the parity alone is fixed)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if count <= 1 or (port // 2) % count == index % count:
            break
    return port


def _worker(
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import gc

    import torch

    # Everything so far (the forkserver's preloaded modules, the arguments) lives until exit:
    # out of the collector, so that the full collections of teardown (``destroy_layouts``) scan
    # only what the body made (~0.3-0.5 s less per rank and call).
    gc.freeze()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        from megatron_earl import runtime

        try:
            runtime.initialize(timeout_s=float(env.get("MEGATRON_EARL_PG_TIMEOUT", "120")))
        except Exception as err:
            if "EADDRINUSE" in str(err) or "address already in use" in str(err):
                results.put((rank, "port", str(err)))
                return
            raise
        value = fn(*args, **kwargs)
        # Plain pickle: tensors travel by value. The queue's own pickler would share them through
        # file descriptors that vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as err:
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        _teardown()


def _teardown() -> None:
    import torch.distributed as dist

    try:
        from megatron_earl.parallel.state import destroy_layouts

        destroy_layouts()
    except Exception:  # best effort at process exit: a failed rank is reported already
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _launch(fn, world_size, args, kwargs, timeout_s, env)
        except _PortTaken as taken:
            if attempt == PORT_ATTEMPTS - 1:
                raise DistributedTestError(
                    f"{fn.__name__}: the rendezvous port was taken {PORT_ATTEMPTS} times: {taken}"
                ) from None
    raise AssertionError("unreachable")


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    timeout_s: float,
    env: dict[str, str] | None,
) -> list[Any]:
    """One launch of ``run_distributed`` on a fresh port; ``_PortTaken`` if rank 0 could not
    bind it."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    child_env = {"MEGATRON_EARL_PG_TIMEOUT": str(int(timeout_s)), **(env or {})}
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, child_env, fn, tuple(args), dict(kwargs or {}), results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in values
                ]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise DistributedTestError(
                        f"{fn.__name__}: rank(s) {dead} died without reporting (exit codes {codes})"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise DistributedTestError(
                        f"{fn.__name__}: timed out after {timeout_s:.0f}s; ranks {missing} did not "
                        "finish (killed)"
                    ) from None
                continue
            if status == "port":
                raise _PortTaken(value)
            if status == "error":
                raise DistributedTestError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [values[r] for r in range(world_size)]
