"""How the embedded engine computes (``rollout.embedded``, ``rollout.engine: embedded``).

    rollout:
      engine: embedded
      embedded:
        decode_threads: 1       # torch threads of a decode step (0: the prefill's)
        compile_decode: true    # torch.compile the decode step (tp 1 rollout layouts)
        compile_prefill: true   # torch.compile prefill steps of small attention (tp 1)

The same switches exist on ``megatron-earl serve`` (``--decode-threads``,
``--compile-decode`` / SGLang's ``--enable-torch-compile``, ``--compile-prefill``).
``EmbeddedEngineConfig`` (``rollout/embedded/engine.py``) says what they do, ``docs/engines.md``
what they cost and gain.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_ENGINE_ROWS = 64
"""KV-cache rows of one embedded engine at most: it decodes ``rollout.max_concurrency`` requests
at once up to this many (the rest wait) and allocates that many rows of ``rollout.max_context``
tokens when it is built (``orchestration.engines.embedded.engine_config``)."""

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

    def __post_init__(self) -> None:
        problems = []
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
