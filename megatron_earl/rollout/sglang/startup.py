"""The run's SGLang engines at start-up: every engine (and the router) answers ``/health``, then
every engine's identity is read and checked (``identity.check_engines``).

    check = await engines_at_start(config)   # EngineError naming what does not answer,
    check.raise_problems()                   # EngineMismatch naming the first difference

Called twice per run: by ``megatron-earl train``'s pre-flight in torchrun's process
(``cli.checked_torchrun``), so that a dead or mismatched engine stops the run before any worker
starts, and by every trainer rank (``orchestration.engines.sglang``), which takes the engines' TP
size from it (the engines may have changed in between)."""

from __future__ import annotations

import asyncio

from megatron_earl.config.run import RunConfig
from megatron_earl.rollout.engine import EngineError
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.identity import EngineCheck, check_engines, read_identity


async def engines_at_start(config: RunConfig) -> EngineCheck:
    """Reachability of ``rollout.engine_urls`` and ``rollout.sglang.router_url`` (2 retries
    each, 5 s to connect), then the identity check of the engines (module docstring). Raises
    ``EngineError`` naming the ones that do not answer."""
    sglang = config.rollout.sglang
    urls = [*config.rollout.engine_urls, *([sglang.router_url] if sglang.router_url else [])]
    client_config = ClientConfig(api_key=sglang.api_key(), connect_timeout_s=5.0, max_retries=2)
    clients = [SGLangClient(url, client_config) for url in urls]
    try:
        healthy = await asyncio.gather(*(c.health(retries=2) for c in clients))
        down = [url for url, ok in zip(urls, healthy) if not ok]
        if down:
            raise EngineError(
                f"SGLang engines not reachable at start-up (GET /health): {down}; check "
                "rollout.engine_urls / rollout.sglang.router_url and that the servers are up"
            )
        engines = clients[: len(config.rollout.engine_urls)]
        identities = await asyncio.gather(*(read_identity(c) for c in engines))
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    return check_engines(identities, sglang, config.model)
