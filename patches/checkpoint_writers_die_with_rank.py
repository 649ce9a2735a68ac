"""Checkpoint writer processes that die with their rank.

What: ``writers_die_with_rank()`` (scoped: ``save_checkpoint`` enters it around one
  ``dist_checkpointing.save``): every process the saving thread forks meanwhile -- megatron-core's
  torch_dist writers, one per write bucket
  (``FileSystemWriterAsync.write_preloaded_data_multiproc``, "fork" context) -- first asks the
  kernel for SIGKILL when the rank dies (``PR_SET_PDEATHSIG``, ``compat.processes``), and exits
  at once if the rank is already gone. Through an ``os.register_at_fork`` hook, registered once;
  outside the scope, and in other threads, forks are untouched.
Why: a rank killed while it waits for its writers (SIGKILL, the OOM killer, the watchdog) left
  them running forever, each holding a copy of the rank's memory: a writer that finishes calls
  ``JoinableQueue.task_done``, whose ``Condition.notify_all`` waits for every sleeper (the dead
  rank, in ``count_queue.join()``) to acknowledge. Reproduced: SIGKILL of rank 0 mid-save left
  the writer sleeping under init.
Versions: megatron-core>=0.16.0,<0.17.0 (writers forked by ``write_preloaded_data_multiproc``, as
  in 0.16.1).
Test: tests/integration/test_run_signals.py
  (test_sigkill_of_rank0_mid_checkpoint_leaves_no_writer)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from megatron_earl.compat.processes import die_with_parent
from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
_WRITER = "FileSystemWriterAsync.write_preloaded_data_multiproc"
TARGETS = (Target("megatron.core.dist_checkpointing.strategies.filesystem_async", _WRITER),)

_saving: tuple[int, int] | None = None
"""(pid, thread id) of the save in progress in this process, else None."""
_registered = False


def apply() -> bool:
    """Check the targets (this patch is scoped: ``save_checkpoint`` enters it per save). Local."""
    check_targets(__name__, VERSIONS, TARGETS)
    return False


def _after_fork_in_child() -> None:
    global _saving
    saving, _saving = _saving, None  # this child's own forks are not writers
    if saving is not None and threading.get_ident() == saving[1]:
        die_with_parent(signal.SIGKILL, saving[0])


@contextlib.contextmanager
def writers_die_with_rank() -> Iterator[None]:
    """Processes this thread forks inside the block die with this process (module docstring).
    Local."""
    global _saving, _registered
    if not _registered:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _registered = True
    previous = _saving
    _saving = (os.getpid(), threading.get_ident())
    try:
        yield
    finally:
        _saving = previous
