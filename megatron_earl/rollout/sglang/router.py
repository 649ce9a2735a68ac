"""SGLang's own router (the ``sglang-router`` package, a Rust binary) in front of N engines.

    with RouterProcess(RouterConfig(port=30100, policy="cache_aware"), engine_urls) as router:
        router.wait_ready(timeout_s=60)
        client = SGLangClient(router.url, ClientConfig(api_key=key))   # generation goes here

What RL stacks do with SGLang (slime): rollouts are sent to the router, which balances them over
the engines (``policy``: ``cache_aware`` keeps a conversation on the engine whose prefix cache
holds it, ``round_robin``, ``power_of_two``, ``random``) and retries a request whose engine failed
on another one; weight updates and pause/flush/continue go to every engine directly (the router
does not fan out control calls). ``build_router_command`` is pure; ``RouterProcess`` runs it in
its own process group and ``wait_ready`` polls the router's ``/workers`` until every engine is
registered and healthy (a clear error naming the engines that are not, or the router's exit).
``sglang-router`` is the optional dependency ``[router]``; nothing here imports it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_earl.rollout.sglang.launcher import free_port, log_tail, lost_its_port, stop_group

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass(frozen=True)
class RouterConfig:
    """One ``python -m sglang_router.launch_router`` process."""

    port: int = 30100
    """The router's HTTP port (clients send generation here)."""
    host: str = "127.0.0.1"
    """Bind address."""
    policy: str = "cache_aware"
    """Load-balancing policy, one of ``POLICIES``."""
    api_key: str | None = None
    """Sent by the router to the engines (their ``--api-key``)."""
    max_retries: int = 3
    """Attempts of a request whose engine failed (the router's ``--retry-max-retries``)."""
    health_check_interval_s: int = 2
    """How often the router polls each engine's ``/health`` (``--health-check-interval-secs``)."""
    request_timeout_s: int = 1800
    """The router's per-request timeout."""
    metrics_port: int = 0
    """Port of the router's Prometheus exporter (0: a free port picked at start; the router's
    fixed default collides when two routers share a node)."""
    extra_args: tuple[str, ...] = ()
    """Further arguments, appended verbatim."""
    python: str = sys.executable
    """Interpreter that has ``sglang-router`` installed."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"router port must be in (0, 65536), got {self.port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"router metrics_port must be in [0, 65536), got {self.metrics_port}")
        if self.policy not in POLICIES:
            raise ValueError(f"router policy {self.policy!r} is not one of {list(POLICIES)}")
        for name in ("max_retries", "health_check_interval_s", "request_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"router {name} must be >= 1, got {getattr(self, name)}")


def build_router_command(config: RouterConfig, engine_urls: Sequence[str]) -> list[str]:
    """The command line that starts the router over ``engine_urls``."""
    if not engine_urls:
        raise ValueError("the router needs at least one engine URL")
    bad = [u for u in engine_urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"engine URLs {bad} must start with http:// or https://")
    cmd = [
        config.python,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *engine_urls,
        "--host",
        config.host,
        "--port",
        str(config.port),
        "--policy",
        config.policy,
        "--retry-max-retries",
        str(config.max_retries),
        "--health-check-interval-secs",
        str(config.health_check_interval_s),
        "--request-timeout-secs",
        str(config.request_timeout_s),
        "--log-level",
        "warn",
        "--prometheus-host",
        config.host,
        "--prometheus-port",
        str(config.metrics_port or free_port(config.host)),
    ]
    if config.api_key:
        cmd += ["--api-key", config.api_key]
    return cmd + list(config.extra_args)


class RouterProcess:
    """A started router; a context manager that stops it on exit."""

    def __init__(
        self,
        config: RouterConfig,
        engine_urls: Sequence[str],
        *,
        log_path: str | None = None,
        rebind_on_conflict: bool = False,
    ) -> None:
        """``rebind_on_conflict``: as ``ServerProcess``'s -- the port was picked free by the
        caller, so a router that exits because another socket took it (or its metrics port)
        meanwhile is started again on new free ports by ``wait_ready`` (``url`` follows), at
        most 3 times."""
        if rebind_on_conflict and not log_path:
            raise ValueError("rebind_on_conflict needs log_path (the bind error is read there)")
        self.config = config
        self.engine_urls = list(engine_urls)
        self._log_path = log_path
        self._rebinds = 3 if rebind_on_conflict else 0
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self._start()

    def _start(self) -> None:
        self.url = f"http://{self.config.host}:{self.config.port}"
        self.process = subprocess.Popen(
            build_router_command(self.config, self.engine_urls),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _lost_its_port(self) -> bool:
        self._log.flush()
        return lost_its_port(log_tail(self._log_path))

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def workers(self) -> dict[str, bool]:
        """Engine URL -> healthy, as the router sees them (its ``/workers``)."""
        request = urllib.request.Request(self.url + "/workers", headers=self._headers())
        with urllib.request.urlopen(request, timeout=5) as resp:
            body = json.loads(resp.read())
        return {w["url"]: bool(w.get("is_healthy")) for w in body.get("workers", [])}

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll until every engine is registered and healthy; raises naming what is missing."""
        deadline = time.monotonic() + timeout_s
        seen: dict[str, bool] = {}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self._rebinds and self._lost_its_port():
                    self._rebinds -= 1
                    self.config = dataclasses.replace(self.config, port=free_port(self.config.host))
                    self._start()
                    continue
                missing = [u for u in self.engine_urls if not seen.get(u)]
                raise RuntimeError(
                    f"router {self.url} exited with code {self.process.returncode} before "
                    f"engines {missing} were registered and healthy (log: "
                    f"{self._log_path or 'not kept'}); is sglang-router installed "
                    "(pip install 'megatron-earl[router]')?"
                )
            try:
                seen = self.workers()
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                seen = {}
            if all(seen.get(url) for url in self.engine_urls):
                return
            time.sleep(0.2)
        missing = [u for u in self.engine_urls if not seen.get(u)]
        raise TimeoutError(
            f"router {self.url}: engines {missing} not registered and healthy after "
            f"{timeout_s:.0f}s (the router reached: {seen or 'none'})"
        )

    def stop(self, stop_timeout_s: float = 10.0) -> int:
        """SIGTERM the process group, SIGKILL it after ``stop_timeout_s``; returns the exit code."""
        stop_group(self.process, stop_timeout_s)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL
        return self.process.returncode

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
