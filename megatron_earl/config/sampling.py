"""``SamplingParams``: the sampling settings of one generation request (SGLang's
``sampling_params`` subset). The rollout engines (``rollout.engine``) take it per request; the
run config holds the default one under ``rollout.sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (SGLang's ``sampling_params`` subset)."""

    max_new_tokens: int = 128
    """Tokens to generate at most."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (the matched id is kept in the output)."""
    stop: tuple[str, ...] = ()
    """Strings that end generation once the detokenized output contains them."""
    seed: int | None = None
    """Per-request sampling seed (reproducible sampling), None for the engine's stream."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
