"""``SamplingParams``: the sampling settings of one generation request (SGLang's
``sampling_params`` subset). The rollout engines (``rollout.engine``) take it per request; the
run config holds the default one under ``rollout.sampling``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

SAMPLING_EPS = 1e-6
"""Temperatures below this are greedy (SGLang's convention: ``logits / 1e-300`` overflows)."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (SGLang's ``sampling_params`` subset)."""

    max_new_tokens: int = 128
    """Tokens to generate at most; 0 only prefills (the prompt's log-probs, as SGLang)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability (after temperature) is below ``min_p`` times the most
    likely token's, in [0, 1]; 0 disables."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (the matched id is kept in the output)."""
    stop: tuple[str, ...] = ()
    """Strings that end generation once the detokenized output contains them."""
    seed: int | None = None
    """Per-request sampling seed (reproducible sampling), None for the engine's stream."""

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if isinstance(self.stop_token_ids, str) or not all(map(_is_int, self.stop_token_ids)):
            ids = self.stop_token_ids
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or null, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or below ``SAMPLING_EPS``."""
        return self.temperature < SAMPLING_EPS


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)
