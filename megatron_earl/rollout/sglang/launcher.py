"""Start SGLang servers (``python -m sglang.launch_server ...``), wait for health, stop them.

    with ServerProcess(LaunchConfig(model_path="/ckpt/qwen", port=30000, tp_size=2)) as server:
        server.wait_healthy(timeout_s=600)
        client = SGLangClient(server.url)

``build_command`` is pure (the project's chosen arguments, tested as a list). The process runs in
its own process group, so ``stop()`` (SIGTERM, then SIGKILL after ``stop_timeout_s``) reaches
SGLang's scheduler/detokenizer children too. ``module`` can name another server that speaks the
same protocol and flags: the tests start ``megatron_earl.rollout.serve.server`` this way.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

SGLANG_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
"""Environment of every SGLang engine a run uses: log-probs of the untempered distribution (at a
temperature other than 1 SGLang returns the tempered one's otherwise; the trainer's and the
embedded engine's are of the raw logits, so the importance ratio would be off by the
temperature)."""
SGLANG_CPU_ENV = {**SGLANG_ENV, "SGLANG_USE_CPU_ENGINE": "1"}
"""On a CPU-only machine (``scripts/install_sglang_cpu.sh``): without ``SGLANG_USE_CPU_ENGINE``
``--device cpu`` still takes GPU code paths."""


def sglang_cpu_args(max_total_tokens: int = 4096, dtype: str = "float32") -> tuple[str, ...]:
    """SGLang's flags for its CPU path: torch-native attention, no CUDA graphs, the checkpoint's
    dtype (``auto`` would serve an fp32 checkpoint in fp16) and a capped KV pool (uncapped, SGLang
    sizes it from the machine's free RAM: ~13 GB and ~2 min of start-up on a 24 GiB machine)."""
    return (
        "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
        "--dtype", dtype, "--max-total-tokens", str(max_total_tokens),
    )  # fmt: skip


@dataclass(frozen=True)
class LaunchConfig:
    """One SGLang server: what ``python -m sglang.launch_server`` is given."""

    model_path: str
    """HF model directory (``config.json`` + safetensors, tokenizer when present), for SGLang and
    ``megatron-earl serve`` alike; ``serve`` also takes a ``torch.save``'d full Megatron state
    file or ``random`` (both shaped by ``--model-config`` in ``extra_args``)."""
    port: int = 30000
    """HTTP port."""
    host: str = "127.0.0.1"
    """Bind address (loopback unless the trainer is on another node)."""
    tp_size: int = 1
    """Tensor-parallel ranks of this engine: SGLang's GPUs; ``megatron-earl serve``'s processes
    (rank 0 starts N-1 followers, ``rollout.serve.tp``). The trainer's
    ``rollout.sglang.engine_tp`` must equal it (tensor payloads, distributed group ranks)."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights + KV cache (None: SGLang's default)."""
    enable_memory_saver: bool = False
    """Allow ``release/resume_memory_occupation`` (colocated training)."""
    api_key: str | None = None
    """``--api-key``: required by the server on its endpoints."""
    skip_server_warmup: bool = True
    """Skip SGLang's warm-up request (health is polled instead)."""
    weight_dirs: tuple[str, ...] = ()
    """``megatron-earl serve`` only: directories ``update_weights_from_disk`` may read
    (``--weight-dirs``; none: disk updates refused). SGLang has no such flag."""
    extra_args: tuple[str, ...] = ()
    """Further arguments, appended verbatim."""
    module: str = "sglang.launch_server"
    """Module run with ``python -m``."""
    python: str = sys.executable
    """Interpreter."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in (0, 65536), got {self.port}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.weight_dirs and self.module == "sglang.launch_server":
            raise ValueError(
                f"weight_dirs {list(self.weight_dirs)}: SGLang has no --weight-dirs (it is "
                "megatron-earl serve's restriction of update_weights_from_disk)"
            )
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )


def build_command(config: LaunchConfig) -> list[str]:
    """The command line that starts the server."""
    cmd = [
        config.python,
        "-m",
        config.module,
        "--model-path",
        config.model_path,
        "--tp-size",
        str(config.tp_size),
        "--host",
        config.host,
        "--port",
        str(config.port),
    ]
    if config.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(config.mem_fraction_static)]
    if config.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if config.api_key:
        cmd += ["--api-key", config.api_key]
    if config.skip_server_warmup:
        cmd.append("--skip-server-warmup")
    if config.weight_dirs:
        cmd += ["--weight-dirs", ",".join(config.weight_dirs)]
    return cmd + list(config.extra_args)


def stop_group(process: subprocess.Popen, stop_timeout_s: float) -> None:
    """SIGTERM the process group led by ``process``, SIGKILL it after ``stop_timeout_s``."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=stop_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def log_tail(path: str, nbytes: int = 4096) -> str:
    """The last ``nbytes`` of the file at ``path``, decoded leniently."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - nbytes))
        return f.read().decode(errors="replace")


def lost_its_port(log_tail: str) -> bool:
    """Whether a process whose log ends with ``log_tail`` exited because its port was taken
    (Python's, uvicorn's and the Rust router's wording all contain this)."""
    return "address already in use" in log_tail.lower()


def free_port(host: str) -> int:
    """A port free on ``host`` now (the caller binds it later: see ``rebind_on_conflict``)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A started server process; a context manager that stops it on exit."""

    def __init__(
        self,
        config: LaunchConfig,
        *,
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        rebind_on_conflict: bool = False,
    ) -> None:
        """``rebind_on_conflict``: the port was picked free by the caller (nothing else expects
        it), so a server that exits because another socket took it in the meantime
        ("address already in use" in ``log_path``) is started again on a new free port by
        ``wait_healthy`` (``url`` follows), at most 3 times."""
        if rebind_on_conflict and not log_path:
            raise ValueError("rebind_on_conflict needs log_path (the bind error is read there)")
        self.config = config
        self._env = {**os.environ, **(env or {})}
        self._log_path = log_path
        self._rebinds = 3 if rebind_on_conflict else 0
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self._start()

    def _start(self) -> None:
        self.url = f"http://{self.config.host}:{self.config.port}"
        self.process = subprocess.Popen(
            self.command(),
            env=self._env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def command(self) -> list[str]:
        """The command line that starts the server."""
        return build_command(self.config)

    def _log_tail(self, nbytes: int = 4096) -> str:
        """The last ``nbytes`` of the server's log ("" without ``log_path``)."""
        if not self._log_path:
            return ""
        self._log.flush()
        return log_tail(self._log_path, nbytes)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float = 600.0, path: str = "/health_generate") -> None:
        """Poll ``path`` until 200; raises if the process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self._rebinds and lost_its_port(self._log_tail()):
                    self._rebinds -= 1
                    port = free_port(self.config.host)
                    self.config = dataclasses.replace(self.config, port=port)
                    self._start()
                    continue
                tail = self._log_tail(2048)
                raise RuntimeError(
                    f"server {self.url} exited with code {self.process.returncode} before it was "
                    f"healthy; command: {' '.join(self.command())}"
                    + (f"\nlast lines of {self._log_path}:\n{tail}" if tail else "")
                )
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server {self.url} not healthy after {timeout_s:.0f}s")

    def stop(self, stop_timeout_s: float = 20.0) -> int:
        """SIGTERM the process group, SIGKILL it after ``stop_timeout_s``; returns the exit code."""
        stop_group(self.process, stop_timeout_s)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL
        return self.process.returncode

    def kill(self) -> None:
        """Kill the server at once (failure injection)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def stop_all(servers: Sequence[ServerProcess], stop_timeout_s: float = 20.0) -> list[int]:
    """``stop()`` every server at once (each waits for its process to exit; stopped one after
    the other, their exits would add up); their exit codes, in order."""
    if not servers:
        return []
    with ThreadPoolExecutor(len(servers)) as pool:
        return list(pool.map(lambda server: server.stop(stop_timeout_s), servers))
