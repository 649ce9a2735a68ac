"""The hang watchdog: every rank beats a heartbeat and says what it is doing; a rank whose
heartbeat stops (a stopped or frozen process) makes its neighbour stop the job with an error
that names it.

    heartbeat = Heartbeat()
    board = StoreBoard(rendezvous_store(), launch=launch_token())
    watchdog = Watchdog(board, rank, world, timeout_s=300, heartbeat=heartbeat,
                        on_stuck=stop_job).start()
    with heartbeat.activity(Activity.ROLLOUT):      # the main thread, around each phase
        ...
    heartbeat.step = 3
    watchdog.stop()                                 # posts "done": nothing left to watch

A daemon thread of every rank posts its record (rank, pid, host, activity, step, seconds in the
activity, a beat counter) on the board every ``interval_s`` and at every change of activity, and
reads the record of the next rank in the ring ((r + 1) mod world). The thread runs while the main
thread computes or waits in a collective, so a heartbeat stops only when the whole process does
(SIGSTOP, a frozen host, a C call holding the GIL forever). When the watched rank's beat counter
has not changed for ``timeout_s`` (measured on the watcher's own monotonic clock, so clocks of
other hosts do not matter), ``on_stuck(message, peer)`` runs on the watcher's thread; the
trainer's (``cli.train``) prints the message, kills the stuck process when it is on this host
and exits, and torchrun then stops the other ranks. Ring watching costs one small store read per
rank and interval at any scale, and catches any set of stuck ranks short of all of them (some
healthy rank precedes a stuck one in the ring).

The board is the job's rendezvous store (``StoreBoard``: the TCP store torchrun's agent, or rank
0 under plain srun, serves at ``MASTER_ADDR:MASTER_PORT``; keys under the launch's token, so an
earlier launch's records are never read), reached through a client of its own with a short
timeout: nothing on disk, so node-local run directories work. A board that does not answer is
not a silent peer: after ``timeout_s`` without an answer the watcher stops the job naming the
store, and kills nobody.

A rank stuck inside a collective with live threads (its peer is the stopped one, or a deadlock)
is not the watchdog's job: the collective timeout (``runtime.collective_timeout_s``) fails it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_earl.config.vocab import Activity


class Heartbeat:
    """What this rank is doing (set by the main thread, read by the watchdog's thread)."""

    def __init__(self) -> None:
        self.current = Activity.STARTUP
        self.since = time.monotonic()
        self.step = 0
        """The RL step being run (``RLLoop.step`` + 1 inside a step)."""
        self.changed = threading.Event()
        """Set at every change of activity (the watchdog then beats at once, so the file names
        the activity even when the process stops right after the change)."""

    @contextlib.contextmanager
    def activity(self, activity: Activity) -> Iterator[None]:
        """Report ``activity`` inside the block, the previous one after it. Local."""
        previous = self.current, self.since
        self.set(activity)
        try:
            yield
        finally:
            self.current, self.since = previous
            self.changed.set()

    def set(self, activity: Activity) -> None:
        self.current, self.since = activity, time.monotonic()
        self.changed.set()

    def describe(self) -> str:
        """``"'train' of step 3 (for 12.0 s)"``."""
        return (
            f"{self.current.value!r} of step {self.step} "
            f"(for {time.monotonic() - self.since:.1f} s)"
        )


@dataclass(frozen=True)
class Peer:
    """The last heartbeat read of a watched rank."""

    rank: int
    pid: int | None = None
    host: str | None = None
    activity: str | None = None
    step: int | None = None
    in_activity_s: float | None = None


class BoardUnreachable(Exception):
    """The board did not answer (its store timed out or refused the connection)."""


class StoreBoard:
    """Heartbeat records in a ``torch.distributed`` store, one key per rank under the launch's
    token: ``post`` replaces this rank's record, ``read`` returns a rank's (None before its first
    post) or raises ``BoardUnreachable``. Thread-safe as the store client is (one client, used by
    the watchdog's thread only)."""

    def __init__(self, store: Any, launch: str) -> None:
        self.store = dist.PrefixStore(f"earl/watchdog/{launch}/", store)
        self.where = getattr(store, "host", None) and f"{store.host}:{store.port}"
        """``host:port`` of a TCP store (for the message when it does not answer)."""

    def post(self, rank: int, record: str) -> None:
        try:
            self.store.set(f"rank_{rank}", record)
        except (RuntimeError, OSError) as err:  # DistStoreError, DistNetworkError, ...
            raise BoardUnreachable(str(err)) from err

    def read(self, rank: int) -> str | None:
        key = f"rank_{rank}"
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode()
        except (RuntimeError, OSError) as err:
            raise BoardUnreachable(str(err)) from err


def rendezvous_store(timeout_s: float) -> Any:
    """A client of its own (``timeout_s`` per operation) to the job's rendezvous store at
    ``MASTER_ADDR:MASTER_PORT``: torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``) or
    the store rank 0 hosts under plain srun (``compat.launch_env``). Local; the environment is
    the one ``runtime.initialize`` joined the world with."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class Watchdog:
    """This rank's heartbeat writer and ring watcher (see the module docstring)."""

    def __init__(
        self,
        board: StoreBoard,
        rank: int,
        world_size: int,
        *,
        timeout_s: float,
        heartbeat: Heartbeat,
        on_stuck: Callable[[str, Peer], None],
        interval_s: float | None = None,
    ) -> None:
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"watchdog timeout_s ({timeout_s!r}) must be a finite number > 0")
        self.board = board
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.heartbeat = heartbeat
        self.on_stuck = on_stuck
        self.interval_s = interval_s or min(max(timeout_s / 5, 0.1), 10.0)
        self.watched = (rank + 1) % world_size if world_size > 1 else None
        self._beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="earl-watchdog", daemon=True)
        self._seen: tuple[int | None, float] = (None, time.monotonic())
        self._answered = time.monotonic()
        """When the board last answered a read."""
        self.peer: Peer | None = None
        """The stuck rank, once ``check`` found one."""
        self._host = socket.gethostname()

    def start(self) -> Watchdog:
        self._seen = (None, time.monotonic())
        self._answered = time.monotonic()
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and mark this rank done (its neighbour stops watching it). Local."""
        self._stop.set()
        self.heartbeat.changed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)
        self.heartbeat.set(Activity.DONE)
        self._beat()

    def check(self) -> str | None:
        """Read the watched rank's heartbeat; the error message when it has been silent for
        ``timeout_s`` (None otherwise). Called by the thread; public for tests."""
        if self.watched is None:
            return None
        now = time.monotonic()
        try:
            record = self._read(self.watched)
        except BoardUnreachable as err:
            if now - self._answered <= self.timeout_s:
                return None
            self.peer = Peer(self.watched)
            return (
                f"watchdog: the heartbeat board ({self.board.where or 'the rendezvous store'}) "
                f"has not answered for {now - self._answered:.1f} s "
                f"(runtime.watchdog_timeout_s={self.timeout_s:g}; last error: {err}): the job's "
                "rendezvous store is down or its host is stopped; stopping the job"
            )
        self._answered = now
        if record is not None and record.get("activity") == Activity.DONE:
            self._seen = (None, now)
            return None
        beat = record.get("beat") if record is not None else None
        if beat is None or beat != self._seen[0]:
            if beat is not None:
                self._seen = (beat, now)
            if beat is not None or now - self._seen[1] <= self.timeout_s:
                return None
        silent = now - self._seen[1]
        if silent <= self.timeout_s:
            return None
        self.peer = Peer(
            self.watched,
            *(
                (record.get(k) for k in ("pid", "host", "activity", "step"))
                if record
                else (None,) * 4
            ),
            in_activity_s=(record.get("in_activity_s", 0.0) + silent) if record else None,
        )
        p = self.peer
        if record is None:
            return (
                f"watchdog: rank {p.rank} has given no heartbeat for {silent:.1f} s since this "
                f"rank started watching (runtime.watchdog_timeout_s={self.timeout_s:g}): it "
                "did not start, or is stopped or frozen; stopping the job"
            )
        return (
            f"watchdog: rank {p.rank} (pid {p.pid} on {p.host}) has given no heartbeat for "
            f"{silent:.1f} s (runtime.watchdog_timeout_s={self.timeout_s:g}): it is stopped or "
            f"frozen in {p.activity!r} of step {p.step} (in it for {p.in_activity_s:.1f} s); "
            "stopping the job"
        )

    # ------------------------------------------------------------------ internals

    def _run(self) -> None:
        changed = self.heartbeat.changed
        while True:
            changed.wait(self.interval_s)
            if self._stop.is_set():
                return
            changed.clear()
            self._beat()
            message = self.check()
            if message is not None:
                self.on_stuck(message, self.peer)
                return

    def _beat(self) -> None:
        self._beats += 1
        hb = self.heartbeat
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": self._host,
            "activity": hb.current.value,
            "step": hb.step,
            "in_activity_s": round(time.monotonic() - hb.since, 3),
            "beat": self._beats,
            "wall_time": time.time(),
        }
        with contextlib.suppress(BoardUnreachable):  # the watchers name an unreachable board
            self.board.post(self.rank, json.dumps(record))

    def _read(self, rank: int) -> dict[str, Any] | None:
        text = self.board.read(rank)
        try:
            return json.loads(text) if text is not None else None
        except ValueError:
            return None


def launch_token(group: Any = None) -> str:
    """A token shared by every rank of this launch (rank 0's, broadcast over ``group``: the
    host world by default). Which ranks call: every rank of the world."""
    from megatron_earl.parallel.groups import host_group

    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0, group=group or host_group())
    return token[0]
