"""Child processes that die with their parent: ``PR_SET_PDEATHSIG`` (Linux); and processes that
exit without CPython's final garbage-collection sweep (``skip_exit_gc``).

    die_with_parent(signal.SIGKILL, parent_pid)     # first thing in a forked child
    skip_exit_gc()                                  # first thing in an entry point's main

The kernel sends the signal when the parent *thread* that forked the child exits, whatever ended
it (even SIGKILL), so a child forked by a process's main thread dies with that process. Elsewhere
(macOS) it does nothing but the early check. Async-signal-safe enough for a ``preexec_fn`` or an
``os.register_at_fork`` hook: ctypes and ``os`` only, nothing imported at call time.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(signum: int, parent: int | None = None) -> None:
    """Have this process receive ``signum`` when its parent dies; exit at once (status 1) if
    the parent ``parent`` (a pid) is already gone. Local."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signum))
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def skip_exit_gc() -> None:
    """Leave out the garbage-collector sweeps of this process's interpreter shutdown: at exit,
    after every other ``atexit`` handler, every live object is frozen (``gc.freeze``) out of the
    collector. With torch and megatron.core imported the sweeps take 1-1.5 s of CPU per process,
    and a ``megatron-earl train`` run ends through three such processes in turn (ranks, torchrun,
    launcher). The rest of a normal exit is unchanged: ``atexit`` handlers, thread joins, objects
    released by reference counting (open files flushed and closed), the exit code. Only objects
    in reference cycles still alive at exit are not collected -- the OS reclaims them. Call it
    from an entry point (a process's ``main``), never from library code."""
    atexit.register(gc.freeze)
