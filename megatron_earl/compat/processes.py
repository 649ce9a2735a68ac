"""Child processes that die with their parent: ``PR_SET_PDEATHSIG`` (Linux).

    die_with_parent(signal.SIGKILL, parent_pid)     # first thing in a forked child

The kernel sends the signal when the parent *thread* that forked the child exits, whatever ended
it (even SIGKILL), so a child forked by a process's main thread dies with that process. Elsewhere
(macOS) it does nothing but the early check. Async-signal-safe enough for a ``preexec_fn`` or an
``os.register_at_fork`` hook: ctypes and ``os`` only, nothing imported at call time.
"""

from __future__ import annotations

import ctypes
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
