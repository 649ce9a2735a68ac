"""Who may call which ``serve`` endpoint, and how large, slow or many its requests may be.

Authorization follows SGLang 0.5.23's ``sglang.srt.utils.auth.decide_request_auth`` (read from
the pinned wheel; ``tests/unit/test_server_auth.py`` holds the decision table):

* health, readiness and metrics paths (prefixes ``/health``, ``/ready``, ``/metrics``) are always
  open, so probes (the router's, Kubernetes') need no secret;
* *admin* endpoints (SGLang's ``AuthLevel.ADMIN_OPTIONAL``: weight updates, flush, pause/continue,
  abort, memory release) need the admin key when one is set, else the API key when one is set,
  else nothing;
* every other endpoint (generation, model/server info, load, ...) needs the API key when one is
  set (an admin key alone leaves them open, as in SGLang).

One cell differs from SGLang's table: SGLang lets ``OPTIONS`` through unchecked (its routes then
answer 405); here ``OPTIONS`` needs the key like every method (then 405 as well: every route is
registered for SGLang's methods, never ``*``, so no handler runs). The path decided on is the
matched route's registered path (``compat.http_guard.route_path``), never the raw request path;
a request that matched no route needs the API key when one is set.

Keys travel as ``Authorization: Bearer KEY`` and are compared in constant time. A refusal is 401
(wrong or missing key). Pure functions, no I/O; ``error_response`` builds the one error body
every endpoint answers with (``{"error": {"message", "code"}}``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from megatron_earl.compat.http_guard import bearer_matches


def error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    """The error answer of every ``serve`` endpoint: ``{"error": {"message", "code"}}``."""
    body = {"error": {"message": message, "code": status}}
    return web.json_response(body, status=status, headers=headers)


OPEN_PREFIXES = ("/health", "/ready", "/metrics")
ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/destroy_weights_update_group",
        "/update_weight_version",
        "/get_weights_by_name",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
    }
)
TENSOR_UPDATE_PATH = "/update_weights_from_tensor"
"""The one endpoint whose body carries the weights themselves."""
WEIGHT_PATHS = frozenset(
    {TENSOR_UPDATE_PATH, "/update_weights_from_disk", "/update_weights_from_distributed"}
)
"""Endpoints whose bodies may be as large as a weight bucket."""


def allowed(
    path: str | None, header: str | None, api_key: str | None, admin_key: str | None
) -> bool:
    """Whether a request with ``Authorization: header`` may call the route registered as
    ``path`` (None: a request that matched no route), whatever its method."""
    if path is not None and path.startswith(OPEN_PREFIXES):
        return True
    if path in ADMIN_PATHS:
        key = admin_key or api_key
        return key is None or bearer_matches(header, key)
    return api_key is None or bearer_matches(header, api_key)


@dataclass(frozen=True)
class RequestLimits:
    """Body sizes ``serve`` reads at most (larger bodies get 413 before they are read)."""

    max_body_bytes: int = 16 << 20
    """Any endpoint but the weight updates (16 MiB: ~2M token ids of JSON)."""
    max_weight_body_bytes: int = 1 << 30
    """The weight-update endpoints (a base64 bucket of the default 512 MiB is ~683 MiB). A weight
    update peaks at ~2x its body in ``serve``'s memory (the JSON text and the payload string it
    parses to), one tensor update at a time: ~2 GiB at this default."""
    body_timeout_s: float = 30.0
    """Time a client has to send a request body (then 408): a slow or stalled sender holds no
    handler longer (weight updates get 10x)."""
    max_queued_requests: int = 4096
    """Sequences waiting or running in the engine at most; a ``/generate`` that would exceed it
    gets 429 with ``Retry-After`` (nothing of it is queued)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_weight_body_bytes"):
            if getattr(self, name) < 1024:
                raise ValueError(f"{name} must be >= 1024 bytes, got {getattr(self, name)}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")

    def for_path(self, path: str) -> int:
        return self.max_weight_body_bytes if path in WEIGHT_PATHS else self.max_body_bytes

    def body_timeout(self, path: str) -> float:
        return self.body_timeout_s * (10 if path in WEIGHT_PATHS else 1)
