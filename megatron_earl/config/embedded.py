"""How the embedded engine computes (``rollout.embedded``, ``rollout.engine: embedded``).

    rollout:
      engine: embedded
      embedded:
        decode_threads: 1       # torch threads of a decode step (0: the prefill's)
        compile_decode: true    # torch.compile the decode step (tp 1 rollout layouts)
        compile_prefill: true   # torch.compile prefill steps of small attention (tp 1)
        kv_memory_fraction: 0.8 # device memory for weights, train state and the KV cache
        kv_cache_mb: null       # or an explicit KV-cache budget per rank (MiB)

The same switches exist on ``megatron-earl serve`` (``--decode-threads``,
``--compile-decode`` / SGLang's ``--enable-torch-compile``, ``--compile-prefill``).
``EmbeddedEngineConfig`` (``rollout/embedded/engine.py``) says what they do, ``docs/engines.md``
what they cost and gain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_ENGINE_ROWS = 64
"""KV-cache rows of one embedded engine at most: it decodes ``rollout.max_concurrency`` requests
at once up to this many, fewer when its memory budget holds fewer rows (``kv_cache_rows``), and
the rest wait; the rows of ``rollout.max_context`` tokens are allocated when the engine is built
(``orchestration.engines.embedded.engine_config``)."""

KV_MEMORY_FRACTION = 0.8
"""Default ``rollout.embedded.kv_memory_fraction`` (SGLang's ``mem_fraction_static``: 0.8 to
0.9 by GPU size): the rest, 20 %, holds the phases' activations, log-prob buffers, the CUDA
context and allocator slack (``megatron-earl plan`` shows whether it does)."""

COMPILE_SWITCHES = ("compile_decode", "compile_prefill")
"""The ``torch.compile`` switches (fields of ``EmbeddedRolloutConfig`` and of
``EmbeddedEngineConfig``, same names): tp = 1 only, each checked the same way."""


class EmbeddedRolloutConfigError(ValueError):
    """An invalid ``rollout.embedded`` section."""


@dataclass(frozen=True)
class EmbeddedRolloutConfig:
    """Compute settings of the embedded engine (``EmbeddedEngineConfig``'s user-facing part)."""

    decode_threads: int = 1
    """``torch`` intra-op threads of a decode step (0: as many as a prefill step). One by
    default: a small model's decode step is many small ops, each parallel region costs a thread
    wake-up that the arithmetic does not repay."""
    compile_decode: bool = False
    """``torch.compile`` the decode step: fewer, fused kernels per step, paid for by one
    compilation at the engine's first step (seconds from inductor's cache, tens of seconds cold).
    Engines of rollout layouts with tp = 1 only; an engine of a tp > 1 layout the selector picks
    runs eagerly (said once in the log); a pinned tp > 1 rollout layout is refused."""
    compile_prefill: bool = False
    """``torch.compile`` the prefill steps whose attention scores number at most
    ``PREFILL_COMPILE_MAX_SCORES`` = 2^22 (sequences x query heads x longest new tokens x
    longest keys: the demo model's 64 prompts of 32 tokens are 2^18; one sequence of a 28-head
    model reaches it at ~390 tokens) and whose shape a graph compiled at the engine's first step
    fits; the rest run eagerly. The same fusions as the decode step's; the same tp = 1
    condition as ``compile_decode``."""

    kv_memory_fraction: float = KV_MEMORY_FRACTION
    """Share of the device's memory that the state living for the whole run may take -- every
    policy copy's weights, the train state (colocated: gradients and optimizer) and the engine's
    KV cache -- like SGLang's ``mem_fraction_static``; the cache gets this share less the
    weights and train state the selector's memory model predicts, in whole rows of
    ``rollout.max_context`` tokens, at most ``min(rollout.max_concurrency, 64)`` rows: more
    requests wait for a row. The rest (1 - fraction) is for activations and the CUDA context.
    In (0, 1]. Used where the device reports its memory (CUDA) and by ``megatron-earl plan`` /
    ``check``; a CPU run keeps ``min(rollout.max_concurrency, 64)`` rows."""
    kv_cache_mb: float | None = None
    """An explicit KV-cache budget per rank in MiB, on any device (the CPU included), in place of
    ``kv_memory_fraction``: the cache takes the rows this holds (at most ``min(
    rollout.max_concurrency, 64)``). None: sized by ``kv_memory_fraction`` on GPUs, today's
    row count on the CPU."""

    def __post_init__(self) -> None:
        problems = []
        fraction = self.kv_memory_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not (math.isfinite(fraction) and 0 < fraction <= 1)
        ):
            problems.append(f"kv_memory_fraction ({fraction!r}) must be a number in (0, 1]")
        budget = self.kv_cache_mb
        if budget is not None and (
            isinstance(budget, bool)
            or not isinstance(budget, int | float)
            or not (math.isfinite(budget) and budget > 0)
        ):
            problems.append(
                f"kv_cache_mb ({budget!r}) must be a number of MiB > 0, or null (sized by "
                "kv_memory_fraction)"
            )
        threads = self.decode_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            problems.append(
                f"decode_threads ({threads!r}) must be an integer >= 0 (0: the prefill's threads)"
            )
        for name in COMPILE_SWITCHES:
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} ({getattr(self, name)!r}) must be true or false")
        if problems:
            raise EmbeddedRolloutConfigError("embedded: " + "; ".join(problems))


def kv_cache_rows(max_rows: int, row_bytes: float, budget_bytes: float | None) -> int:
    """KV-cache rows of an embedded engine: ``max_rows`` (``min(rollout.max_concurrency,
    MAX_ENGINE_ROWS)``), or fewer when ``budget_bytes`` holds fewer whole rows of ``row_bytes``
    (0 when it holds none: the engine cannot start). ``budget_bytes`` None: no memory figure
    (the CPU without ``kv_cache_mb``), ``max_rows``. Pure."""
    if max_rows < 1 or row_bytes <= 0:
        raise ValueError(f"max_rows ({max_rows}) and row_bytes ({row_bytes}) must be > 0")
    if budget_bytes is None:
        return max_rows
    return max(0, min(max_rows, math.floor(budget_bytes / row_bytes)))
