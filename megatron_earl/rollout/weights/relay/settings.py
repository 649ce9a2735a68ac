"""One relay's settings (``RelaySettings``: ``megatron-earl relay --help``) and counters
(``Counters``, reported by ``GET /relay_info``): what ``relay/server.py`` and its engine appliers
(``relay/applier.py``) both read.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from megatron_earl.config.vocab import PauseMode


@dataclass(frozen=True)
class RelaySettings:
    """One relay's settings (``megatron-earl relay --help``)."""

    upstreams: tuple[str, ...] = ()
    """Relays to pull new versions from (none: a root, the trainer publishes here)."""
    engines: tuple[str, ...] = ()
    """Engines this relay loads (SGLang's HTTP API); each engine is fed by one relay."""
    pause_mode: str = PauseMode.RETRACT
    """``pause_generation`` mode around a load into an engine."""
    engine_tp: int | None = None
    """TP ranks of each engine (tensor payloads per bucket); None: each engine's own
    (``/get_server_info``'s ``tp_size``), set: it must equal the engine's (a load into an
    engine with another TP size fails, naming both)."""
    lease_s: float = 60.0
    """A version a child fetched from within this long is not collected."""
    poll_wait_s: float = 10.0
    """Longest wait of one long poll on an upstream."""
    engine_check_s: float = 2.0
    """How often an applier reads its engine's version when no new version arrived (a restarted
    engine is noticed within this)."""
    retry_s: float = 0.2
    """First backoff after a failed pull or load; doubles per failure."""
    retry_max_s: float = 5.0
    """Longest backoff."""
    max_bucket_bytes: int = 2 << 30
    """Largest bucket body accepted."""
    verify_tensors: int = 4
    """Tensors read back from an engine after each load (``get_weights_by_name``: the smallest
    tensor of this many buckets, spread over the version, its first ``VERIFY_ROWS`` rows) and
    compared with the published values; 0: no read-back."""
    api_key: str | None = None
    """``$EARL_RELAY_API_KEY``: required on every endpoint but ``/health`` when set."""
    max_clock_skew_s: float = 60.0
    """A publication's generation (its publisher's start, ms since the epoch) may be at most this
    far ahead of this relay's clock; a later one is refused (400)."""
    release_holders: int = 0
    """0: load an engine as soon as a newer version is here. N > 0: load it only once N
    distinct holders released it since its last load (``POST /engines/release``; a first load
    and a restarted engine's need none)."""

    def __post_init__(self) -> None:
        problems = []
        for url in (*self.upstreams, *self.engines):
            if not url.startswith(("http://", "https://")):
                problems.append(f"URL {url!r} must start with http:// or https://")
        if self.pause_mode not in tuple(PauseMode):
            problems.append(
                f"pause_mode {self.pause_mode!r} is not one of {[str(m) for m in PauseMode]}"
            )
        for name in (
            "lease_s",
            "poll_wait_s",
            "engine_check_s",
            "retry_s",
            "retry_max_s",
            "max_clock_skew_s",
        ):
            if not 0 < getattr(self, name) < math.inf:
                problems.append(f"{name} must be finite and > 0, got {getattr(self, name)}")
        if self.engine_tp is not None and self.engine_tp < 1:
            problems.append(f"engine_tp must be >= 1, got {self.engine_tp}")
        if self.release_holders < 0:
            problems.append(
                f"release_holders must be >= 0 (0: load without release), got "
                f"{self.release_holders}"
            )
        if self.verify_tensors < 0:
            problems.append(f"verify_tensors must be >= 0 (0: off), got {self.verify_tensors}")
        if problems:
            raise ValueError("relay: " + "; ".join(problems))


@dataclass
class Counters:
    published: int = 0
    pulled: int = 0
    checksum_refused: int = 0
    repulls: int = 0
    upstream_errors: int = 0
    collected: int = 0
    engine_mismatches: int = 0
    """Loads after which an engine held other values than the published ones."""
    engine_check_unsupported: int = 0
    """Loads not read back: the engine has no ``get_weights_by_name`` (404) or cannot export
    its weights (SGLang's 400 for e.g. Qwen2/Qwen3 models)."""
    extra: Counter = field(default_factory=Counter)
