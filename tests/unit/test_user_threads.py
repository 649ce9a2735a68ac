"""The worker pool for synchronous user code (``compat.user_threads``): bounded, its
threads are daemons, a call past its timeout keeps only its own thread, an exception (even
``SystemExit``) reaches the caller, and async callables are awaited on the loop.

Run: python -m pytest -q tests/unit/test_user_threads.py
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_earl.compat.user_threads import UserThreads, call_user, is_async


def test_pool_is_bounded_and_stuck_calls_only_hold_their_threads():
    release = threading.Event()
    pool = UserThreads(max_threads=2, name="test-pool")

    async def main():
        stuck = [pool.run(release.wait) for _ in range(3)]  # two threads block, one queues
        await asyncio.sleep(0.2)
        assert pool.num_threads == 2
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-pool"))
        with pytest.raises(asyncio.TimeoutError):  # queued behind the stuck ones
            await asyncio.wait_for(call_user(lambda: 1, threads=pool), 0.3)
        release.set()
        assert await asyncio.gather(*stuck) == [True, True, True]
        assert await call_user(lambda x: x + 1, 41, threads=pool) == 42
        assert pool.num_threads == 2

    asyncio.run(main())


def test_exceptions_reach_the_caller_and_async_callables_stay_on_the_loop():
    pool = UserThreads(max_threads=1)

    def exits():
        raise SystemExit(3)

    class AsyncFn:
        async def __call__(self, x):
            return threading.current_thread() is threading.main_thread(), x

    async def main():
        with pytest.raises(SystemExit):
            await call_user(exits, threads=pool)
        with pytest.raises(ZeroDivisionError):
            await call_user(lambda: 1 / 0, threads=pool)
        assert await call_user(AsyncFn(), 5, threads=pool) == (True, 5)
        on_main = await call_user(
            lambda: threading.current_thread() is threading.main_thread(), threads=pool
        )
        assert on_main is False

    assert is_async(AsyncFn()) and not is_async(exits)
    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match="max_threads >= 1, got 0"):
        UserThreads(0)


def test_an_async_function_that_blocks_the_loop_is_named(monkeypatch):
    """An ``async def`` that calls ``time.sleep`` cannot be moved off the loop, but the warning
    names it (once per function), so the other trajectories' timeouts have a visible cause; an
    async function that awaits its waiting is not named, and cancellation passes through."""
    import megatron_earl.compat.user_threads as ut

    monkeypatch.setattr(ut, "BLOCKING_WARN_S", 0.2)
    monkeypatch.setattr(ut, "_warned", set())

    class Env:
        async def step(self, x):
            await asyncio.sleep(0.01)
            time.sleep(0.3)  # blocks the loop
            return x

        async def polite(self, x):
            await asyncio.sleep(0.3)
            return x

    async def main():
        env = Env()
        assert await call_user(env.step, 1) == 1
        assert await call_user(env.step, 2) == 2  # warned once
        assert await call_user(env.polite, 3) == 3
        task = asyncio.ensure_future(call_user(env.polite, 4))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with pytest.warns(ut.BlockingCallWarning) as record:
        asyncio.run(main())
    messages = [str(w.message) for w in record if issubclass(w.category, ut.BlockingCallWarning)]
    assert len(messages) == 1
    assert "Env.step (async) blocked the event loop for 0.3 s" in messages[0]
