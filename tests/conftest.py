"""Set-up for every pytest process of the suite: like the project's entry points, it exits
without CPython's final garbage-collection sweep (``compat.processes.skip_exit_gc``; ~1.5 s
with torch and megatron.core imported)."""

from __future__ import annotations

from megatron_earl.compat.processes import skip_exit_gc

skip_exit_gc()
