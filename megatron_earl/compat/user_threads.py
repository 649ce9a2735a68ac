"""Synchronous user code (environment methods, reward functions) off the event loop.

    value = await call_user(env.step, action)     # async: awaited; sync: run on a worker thread

A plain function called on the event loop blocks every other trajectory of the loop until it
returns (one ``time.sleep`` in an env's ``step`` made the healthy trajectories of the same step
time out). ``call_user`` awaits a coroutine function as it is and runs anything else on one of a
bounded pool of daemon threads (``UserThreads``), so the caller's timeout (``bounded``) applies
to it like to a coroutine.

A thread cannot be killed: a call that runs past its timeout keeps its thread until it returns
(its result is discarded). The pool is bounded (``MAX_USER_THREADS`` per process), so stuck calls
cannot grow the process without limit; once every thread is stuck, later synchronous calls wait
in the queue and fail at their own timeouts. The threads are daemons and the pool is never
joined: a stuck call does not keep the process (or ``asyncio.run``'s shutdown) from ending.
An ``async def`` method that blocks (calls ``time.sleep`` or blocking I/O without awaiting) still
blocks the loop: that is a bug of the environment, not something a timeout can interrupt. It is
named instead: ``call_user`` times every stretch such a coroutine runs without yielding, and one
longer than ``BLOCKING_WARN_S`` raises a ``BlockingCallWarning`` (once per function) naming the
function, so the cause of the other trajectories' timeouts is visible.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

MAX_USER_THREADS = 32
"""Worker threads for synchronous user code per process, at most."""


class UserThreads:
    """A bounded pool of daemon threads running synchronous calls for asyncio callers."""

    def __init__(self, max_threads: int = MAX_USER_THREADS, name: str = "earl-user") -> None:
        if max_threads < 1:
            raise ValueError(f"UserThreads needs max_threads >= 1, got {max_threads}")
        self.max_threads, self.name = max_threads, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0

    @property
    def num_threads(self) -> int:
        """Threads started so far (never more than ``max_threads``)."""
        return len(self._threads)

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Schedule ``fn(*args)`` on a worker thread; a future of the running loop resolves to
        its result or exception. Cancelling the future discards the outcome (the call itself
        runs to its end)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._idle == 0 and len(self._threads) < self.max_threads:
                thread = threading.Thread(
                    target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            else:
                self._idle -= min(self._idle, 1)
        self._jobs.put((loop, future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            loop, future, fn, args = self._jobs.get()
            try:
                outcome = (True, fn(*args))
            except BaseException as e:  # handed to the caller, never lost
                outcome = (False, e)
            try:
                loop.call_soon_threadsafe(_settle, future, outcome)
            except RuntimeError:  # the caller's loop is closed: nobody waits for the outcome
                pass
            with self._lock:
                self._idle += 1


def _settle(future: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    if future.done():  # cancelled: the caller timed out and went on
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


USER_THREADS = UserThreads()
"""The process's pool for synchronous environment methods and reward functions."""


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns a coroutine without doing the work itself: a coroutine
    function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an instance's async __call__
    )


BLOCKING_WARN_S = 1.0
"""A coroutine of user code that runs this long without yielding is named (it blocked the loop)."""


class BlockingCallWarning(RuntimeWarning):
    """An ``async`` user function blocked the event loop (every other task waited)."""


_warned: set[str] = set()


def _name(fn: Callable[..., Any]) -> str:
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{type(owner).__qualname__}.{fn.__name__}" if owner is not None else name


@types.coroutine
def _watched(coro, fn: Callable[..., Any]):
    """Await ``coro``, timing each stretch it runs without yielding (``BLOCKING_WARN_S``).
    Sends, throws (cancellation) and close pass through unchanged."""
    it = coro.__await__()
    value, error = None, None
    while True:
        start = time.monotonic()
        try:
            yielded = it.send(value) if error is None else it.throw(error)
        except StopIteration as stop:
            _check(fn, time.monotonic() - start)
            return stop.value
        finally:
            value = error = None
        _check(fn, time.monotonic() - start)
        try:
            value = yield yielded
        except BaseException as e:  # CancelledError, GeneratorExit: the coroutine decides
            error = e


def _check(fn: Callable[..., Any], seconds: float) -> None:
    if seconds < BLOCKING_WARN_S:
        return
    name = _name(fn)
    if name in _warned:
        return
    _warned.add(name)
    warnings.warn(
        f"{name} (async) blocked the event loop for {seconds:.1f} s without awaiting: every "
        "other trajectory of this process waited, and may have timed out; make it a plain def "
        "(it then runs on a worker thread) or await its blocking work (asyncio.to_thread)",
        BlockingCallWarning,
        stacklevel=2,
    )


async def call_user(fn: Callable[..., Any], *args: Any, threads: UserThreads | None = None):
    """``fn(*args)``: awaited when ``fn`` is async (a stretch that blocks the loop is named:
    ``BlockingCallWarning``), else run on ``threads`` (default ``USER_THREADS``) so it cannot
    block the event loop; an awaitable it returns is awaited."""
    if is_async(fn):
        return await _watched(fn(*args), fn)
    result = await (threads or USER_THREADS).run(fn, *args)
    if inspect.isawaitable(result):
        result = await result
    return result
