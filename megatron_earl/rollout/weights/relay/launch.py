"""Starting relay processes (tests, benchmarks, scripts): ``RelayProcess`` is a
``ServerProcess`` (health wait, rebind on a lost port, SIGTERM/SIGKILL of its group) whose
command is ``megatron-earl relay``'s.

    with RelayProcess(RelayLaunch(port, upstreams=(root_url,), engines=urls), log_path=...) as r:
        r.wait_healthy(timeout_s=60, path="/health")
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from megatron_earl.rollout.sglang.launcher import ServerProcess


@dataclass(frozen=True)
class RelayLaunch:
    """One relay process: what ``megatron-earl relay`` is given."""

    port: int
    host: str = "127.0.0.1"
    upstreams: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    """Further arguments (``--pause-mode``, ``--engine-check-s`` ...), appended verbatim."""
    python: str = sys.executable

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in (0, 65536), got {self.port}")


def relay_command(launch: RelayLaunch) -> list[str]:
    cmd = [launch.python, "-m", "megatron_earl.rollout.weights.relay.server"]
    cmd += ["--host", launch.host, "--port", str(launch.port)]
    if launch.upstreams:
        cmd += ["--upstream", ",".join(launch.upstreams)]
    if launch.engines:
        cmd += ["--engines", ",".join(launch.engines)]
    return cmd + list(launch.extra_args)


class RelayProcess(ServerProcess):
    """A started ``megatron-earl relay`` (module docstring)."""

    def command(self) -> list[str]:
        return relay_command(self.config)
