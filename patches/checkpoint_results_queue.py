"""An in-process write-results queue for synchronous ``dist_checkpointing`` saves.

What: ``in_process_results_queue()`` (scoped) sets
  ``megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue`` to a plain
  ``queue.Queue`` for the duration of one synchronous save, and restores the previous value on exit
  (async saves, which this project does not use, still get their manager queue).
Why: the torch_dist writer collects its write results through that module-level queue, which it
  creates on first use from a *spawned* ``multiprocessing`` manager. Spawning costs ~10 s per
  process on a loaded 2-core machine and re-imports ``__main__`` (a script without an
  ``if __name__ == "__main__":`` guard hangs). A synchronous save produces and consumes the results
  in this process, so a plain queue is enough.
Versions: megatron-core>=0.16.0,<0.17.0 (``_results_queue`` / ``_get_write_results_queue`` as in
  0.16.1).
Test: tests/distributed/test_checkpoint.py (every save goes through it, e.g.
  test_resume_same_layout_continues_bitwise, test_crash_mid_save_keeps_previous_checkpoint)
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator

from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_QUEUE = Target(_MODULE, "_results_queue")
TARGETS = (_QUEUE, Target(_MODULE, "_get_write_results_queue"))


def apply() -> bool:
    """Check the targets (this patch is scoped: ``save_checkpoint`` enters it per save). Local."""
    check_targets(__name__, VERSIONS, TARGETS)
    return False


@contextlib.contextmanager
def in_process_results_queue() -> Iterator[None]:
    """Run one synchronous save with an in-process results queue. Local."""
    previous = _QUEUE.get()
    _QUEUE.set(queue.Queue())
    try:
        yield
    finally:
        _QUEUE.set(previous)
