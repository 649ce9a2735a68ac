"""Sandboxed Python execution: ``run_python(code)`` and the ``python`` tool.

Each run is a fresh child process (``python -I``) in its own session and temporary directory,
started by one of two backends (``SandboxConfig.backend``; ``auto`` picks ``bwrap`` when it works
here, probed once per interpreter and user, else ``native``). The backend comes first in
``SandboxResult.isolation``.

``bwrap``   bubblewrap (``tools._bwrap``) builds the sandbox with the kernel: a mount namespace
            that shows only ``/usr`` and the interpreter's installation (read-only), the work
            directory (read-write), a private ``/proc``, a minimal ``/dev`` and an empty tmpfs
            ``/tmp`` (layer ``mountns``); new user, PID, network, IPC and UTS namespaces
            (``netns``, ``pidns``: the bootstrap is PID 1, the kernel kills what is left when it
            ends); no capabilities, ``no_new_privs``; as root it runs as ``sandbox_user``
            (``uid``). The bootstrap then applies ``rlimits`` and ``audit`` as below. What the code
            runs (a binary under /usr through ``_posixsubprocess``, a stdlib module the audit hook
            does not see, native code) runs inside the same namespaces, user and limits.
``native``  the layers below, applied by the bootstrap itself with ``unshare(2)``/``setuid``: no
            mount namespace, so the file system is hidden from the code only by the audit hook,
            which is not a security boundary. The fallback where bubblewrap is missing or
            unusable (no user namespaces).

Layers of ``native`` (``rlimits`` and ``audit`` also under ``bwrap``), strongest first, each
recorded when it was applied:

``netns``   ``unshare(CLONE_NEWNET)`` (as root; unprivileged: with ``CLONE_NEWUSER`` where the
            kernel allows). The child sees a network namespace with only a down loopback: no
            connection can leave it, whatever the code does (kernel-enforced).
``uid``     as root, the child drops to an unprivileged uid (``nobody``) with no groups; the
            work directory is chowned to it. Kernel-enforced: writes only where ``nobody`` may
            write (the work directory, world-writable dirs like /tmp), ``RLIMIT_NPROC`` applies.
            Needs an interpreter ``nobody`` can run (``sys.executable`` when every directory on
            its path is world-searchable, else /usr/bin/python3); without one this layer is off.
``rlimits`` ``RLIMIT_CPU`` (SIGXCPU then SIGKILL), ``RLIMIT_AS`` (MemoryError), ``RLIMIT_FSIZE``,
            ``RLIMIT_NOFILE``, no core files, ``RLIMIT_NPROC`` (only with ``uid`` or as a non-root
            user: the kernel exempts root).
``audit``   a ``sys.addaudithook`` hook installed before the user code runs: opens for writing,
            and file-system changes (remove/rename/mkdir/chmod...), outside the work directory
            are refused; reads and listings are allowed only under the work directory and the
            interpreter's installation; sockets, ``exec``/``spawn``/``system``/``subprocess`` and
            ``ctypes`` are refused; ``fork`` is refused when ``RLIMIT_NPROC`` cannot be
            enforced. This layer is in-process: Python code cannot remove the hook and its state
            is immutable (bound at install; rebinding its code or defaults, ``gc`` introspection
            are refused), but the stdlib helpers it calls, native code and internals that raise
            no audit event can get past it: not a security boundary; the kernel layers above
            do not have that weakness.
``pidns``  ``unshare(CLONE_NEWPID)``: the code runs under a reaper that is PID 1 of a fresh PID
            namespace; when the reaper ends (after the code, or killed with the group) the kernel
            kills every process left in the namespace -- also one that left the process group
            with ``setsid``. Every process the call started is gone when it returns.
Always: wall-clock timeout, after which (and after every run) the child's whole process group
is killed with SIGKILL. Without ``pidns`` a process that calls ``setsid`` escapes that kill
(``setsid`` is not an audit event); with ``uid`` it stays bounded by ``RLIMIT_NPROC``/CPU.

Nothing the code can touch is read back: the layers applied come over a pipe the bootstrap
closes before the code starts (under ``bwrap`` the code's wait status comes over a second pipe
from PID 1, read non-blocking after the end: bwrap's own exit status cannot carry a signal),
stdout/stderr are read asynchronously with a size cap, and after
the kill the readers get ``READ_GRACE_S`` to drain before they are dropped (a descendant that
escaped the kill may hold the pipes open; its output is cut there). The work directory is
removed off the event loop, so a file the code left behind (a named pipe, a huge tree) cannot
block the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import pwd
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import psutil

import megatron_earl.tools._bwrap as _bwrap
from megatron_earl.tools.base import TOOLS, Tool

logger = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_sandbox_child.py").read_text()
READ_GRACE_S = 1.0
"""After the kill, how long stdout/stderr readers may drain before they are dropped."""
CLEANUP_TIMEOUT_S = 10.0
"""Removing the work directory (in a thread) is waited for at most this long."""


class SandboxBackend(str, Enum):
    """How the sandbox is built (module docstring)."""

    AUTO = "auto"
    BWRAP = "bwrap"
    NATIVE = "native"


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run."""

    backend: SandboxBackend | str = SandboxBackend.AUTO
    """``auto`` (bubblewrap when it works here, else ``native``), ``bwrap`` (required: a run
    raises when it is missing or unusable) or ``native`` (never bubblewrap)."""
    bwrap: str = "bwrap"
    """The bubblewrap executable: a path, or a name looked up on PATH."""

    wall_timeout_s: float = 5.0
    """Wall-clock limit; the process group is killed after it."""
    cpu_time_s: int = 2
    """RLIMIT_CPU seconds (soft; SIGKILL one second later)."""
    memory_mb: int = 256
    """RLIMIT_AS in MiB (address space, so the interpreter's own mappings count)."""
    max_processes: int = 16
    """Processes the child may have (RLIMIT_NPROC, over the sandbox uid's current count)."""
    max_file_mb: int = 16
    """Largest file the child may write (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 65536
    """stdout/stderr kept per stream; the rest is dropped."""
    net_namespace: bool = True
    """Run in a fresh network namespace when the kernel allows (``native``; ``bwrap`` always
    does)."""
    pid_namespace: bool = True
    """Run under a reaper in a fresh PID namespace when the kernel allows (no process outlives
    the call; ``native``: ``bwrap`` always does)."""
    drop_privileges: bool = True
    """As root, run the code as ``sandbox_user``."""
    sandbox_user: str = "nobody"
    """Unprivileged user of the ``uid`` layer."""
    audit_hook: bool = True
    """Install the in-process audit hook (file-system and process/socket rules)."""
    audit_network: bool = True
    """The audit hook also refuses sockets (off: only the network namespace stops them)."""
    python: str | None = None
    """Interpreter; None picks one the sandbox user can run."""

    def __post_init__(self) -> None:
        valid = [b.value for b in SandboxBackend]
        if self.backend not in valid:
            raise ValueError(f"SandboxConfig.backend must be one of {valid}, got {self.backend!r}")
        object.__setattr__(self, "backend", SandboxBackend(self.backend))
        for name in (
            "wall_timeout_s",
            "cpu_time_s",
            "memory_mb",
            "max_processes",
            "max_file_mb",
            "max_open_files",
            "max_output_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class SandboxResult:
    """Outcome of one run."""

    stdout: str
    stderr: str
    returncode: int | None
    """Exit status; negative = killed by that signal; None when it did not exit in time."""
    timed_out: bool
    """The wall timeout expired."""
    wall_s: float
    isolation: list[str] = field(default_factory=list)
    """The backend, then the layers applied (see the module docstring)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def killed_by(self) -> str | None:
        """``"wall_timeout"``, ``"cpu_limit"``, a signal name, or None."""
        if self.timed_out:
            return "wall_timeout"
        if self.returncode is not None and self.returncode < 0:
            sig = signal.Signals(-self.returncode)
            return "cpu_limit" if sig in (signal.SIGXCPU, signal.SIGKILL) else sig.name
        return None


def _world_runnable(path: str) -> bool:
    p = Path(os.path.realpath(path))
    if not p.exists() or not p.stat().st_mode & stat.S_IXOTH:
        return False
    return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)


def _interpreter(config: SandboxConfig, drop: bool) -> tuple[str, bool]:
    """(interpreter, whether the uid layer can be used with it)."""
    if config.python is not None:
        return config.python, drop and _world_runnable(config.python)
    if not drop:
        return sys.executable, False
    for cand in (sys.executable, shutil.which("python3", path="/usr/bin:/bin")):
        if cand and _world_runnable(cand):
            return cand, True
    return sys.executable, False


async def _read_capped(stream: asyncio.StreamReader, cap: int, kept: bytearray) -> None:
    """Read ``stream`` to its end into ``kept`` (at most ``cap`` bytes kept; the rest dropped)."""
    while chunk := await stream.read(65536):
        kept += chunk[: max(0, cap - len(kept))]


def _drain(fd: int) -> bytes:
    """What is in a pipe (non-blocking: every writer is gone or never wrote), at most 4 KiB."""
    os.set_blocking(fd, False)
    raw = b""
    try:
        while len(raw) < 4096 and (chunk := os.read(fd, 4096)):
            raw += chunk
    except BlockingIOError:
        pass
    return raw


def _read_report(fd: int) -> list[str]:
    """The layers the bootstrap applied, from the report pipe (anything else than a JSON list of
    strings reads as no layer)."""
    try:
        layers = json.loads(_drain(fd))
    except ValueError:
        return []
    return layers if isinstance(layers, list) and all(isinstance(x, str) for x in layers) else []


def _read_status(fd: int) -> int | None:
    """The code's exit code (negative: killed by that signal) from the bwrap bootstrap's status
    pipe; None when it wrote none (it died first) or something else than a wait status."""
    try:
        return os.waitstatus_to_exitcode(int(_drain(fd)))
    except ValueError:
        return None


def _backend(config: SandboxConfig, python: str, user: tuple[int, int] | None) -> _bwrap.Probe:
    """The bubblewrap to use (``Probe.bwrap`` None: the native backend); raises when bubblewrap is
    required and unusable."""
    if config.backend is SandboxBackend.NATIVE:
        return _bwrap.Probe(None, reason="SandboxConfig.backend='native'")
    probe = _bwrap.probe(config.bwrap, python, user)
    if probe.bwrap is None and config.backend is SandboxBackend.BWRAP:
        raise SandboxUnavailableError(
            f"SandboxConfig.backend='bwrap' but bubblewrap is unusable: {probe.reason}. Install "
            f"the distribution package {_bwrap.PACKAGE!r} (scripts/install_system_deps.sh), or "
            "set SandboxConfig.backend to 'auto' or 'native' (whose file-system isolation is "
            "not a security boundary)"
        )
    if probe.bwrap is None:
        _warn_fallback(probe.reason)
    return probe


def sandbox_backend(config: SandboxConfig) -> SandboxBackend:
    """The backend runs with ``config`` use here (``bwrap`` or ``native``); raises
    ``SandboxUnavailableError`` when ``config.backend`` is ``bwrap`` and it is unusable. Probes
    once per bwrap executable, interpreter and user (then cached)."""
    python, use_uid = _interpreter(config, os.geteuid() == 0 and config.drop_privileges)
    probe = _backend(config, python, _sandbox_user(config) if use_uid else None)
    return SandboxBackend(probe.backend)


def _sandbox_user(config: SandboxConfig) -> tuple[int, int]:
    entry = pwd.getpwnam(config.sandbox_user)
    return entry.pw_uid, entry.pw_gid


@functools.cache
def _warn_fallback(reason: str) -> None:
    logger.warning(
        "sandbox: bubblewrap unusable (%s); using the native backend, whose file-system "
        "isolation is an audit hook, not a security boundary",
        reason,
    )


class SandboxUnavailableError(RuntimeError):
    """The configured sandbox backend cannot run here."""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` in a sandboxed child process; never raises for what the code does, and
    returns within ``wall_timeout_s + READ_GRACE_S`` (plus the removal of its directory).
    Raises ``SandboxUnavailableError`` when ``config.backend`` is ``bwrap`` and it is unusable."""
    config = config or SandboxConfig()
    is_root = os.geteuid() == 0
    python, use_uid = _interpreter(config, is_root and config.drop_privileges)
    user = _sandbox_user(config) if use_uid else None
    probe = await asyncio.to_thread(_backend, config, python, user)
    workdir = tempfile.mkdtemp(prefix="earl-sandbox-")
    start = time.monotonic()
    report_r, report_w = os.pipe()
    status_r, status_w = os.pipe() if probe.bwrap else (None, None)
    try:
        Path(workdir, "main.py").write_text(code)
        if user is not None:
            for p in (workdir, os.path.join(workdir, "main.py")):
                os.chown(p, *user)
        if probe.bwrap:  # the processes of the sandbox's own user namespace count (kernel >= 5.14)
            nproc = config.max_processes + 1 if (user or not is_root) else None
        else:
            nproc = config.max_processes + 1  # + the PID-namespace reaper
            if user or not is_root:
                me = user[0] if user else os.getuid()
                nproc += sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"].real == me)
            else:
                nproc = None
        child_cfg = {
            "workdir": workdir,
            "applied": (
                ["bwrap", "mountns", "netns", "pidns"] + (["uid"] if user else [])
                if probe.bwrap
                else ["native"]
            ),
            "report_fd": report_w,
            "status_fd": status_w,
            "uid": None if probe.bwrap or user is None else user[0],
            "gid": None if probe.bwrap or user is None else user[1],
            "net_namespace": config.net_namespace and not probe.bwrap,
            "pid_namespace": config.pid_namespace and not probe.bwrap,
            "cpu": config.cpu_time_s,
            "memory": config.memory_mb * 2**20,
            "nproc": nproc,
            "fsize": config.max_file_mb * 2**20,
            "nofile": config.max_open_files,
            "audit": config.audit_hook,
            "audit_network": config.audit_network,
        }
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
        }
        launcher = _bwrap.command(probe.bwrap, probe.binds, workdir) if probe.bwrap else []
        try:
            proc = await asyncio.create_subprocess_exec(
                *launcher,
                python,
                "-I",
                "-c",
                _CHILD,
                json.dumps(child_cfg),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                cwd=workdir,
                env=env,
                pass_fds=tuple(fd for fd in (report_w, status_w) if fd is not None),
                **(_bwrap.as_user(user) if probe.bwrap else {}),
            )
        finally:
            for fd in (report_w, status_w):
                if fd is not None:
                    os.close(fd)
        kept = (bytearray(), bytearray())
        readers = [
            asyncio.ensure_future(_read_capped(s, config.max_output_bytes, k))
            for s, k in zip((proc.stdout, proc.stderr), kept)
        ]
        # Poll ``returncode`` rather than ``proc.wait()``: on Python 3.11 ``wait()`` also waits
        # for the pipes to close, which leftover children of the code keep open.
        deadline = start + config.wall_timeout_s
        try:
            while proc.returncode is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            timed_out = proc.returncode is None
            # The process group: leftover children of the code too (native), or bwrap's monitor,
            # whose death kills the sandbox's PID 1 and with it the namespace (bwrap).
            _kill_group(proc.pid)
        # Not ``proc.wait()``: on Python 3.11 it also waits for the pipes, which a process that
        # escaped the kill (no PID namespace, ``setsid``) holds open.
        grace_end = time.monotonic() + READ_GRACE_S
        while proc.returncode is None and time.monotonic() < grace_end:
            await asyncio.sleep(0.01)
        _, pending = await asyncio.wait(readers, timeout=max(0.01, grace_end - time.monotonic()))
        if pending:  # pipes still held open by a process that escaped the kill
            for reader in pending:
                reader.cancel()
            # Close our ends now (asyncio's Process has no public close; left to the garbage
            # collector, the transport would be closed after its event loop is gone).
            proc._transport.close()
        returncode = proc.returncode
        if status_r is not None and returncode == 0:
            # bwrap's exit status is PID 1's; the code's own (with its signal) comes over the pipe
            status = _read_status(status_r)
            returncode = returncode if status is None else status
        return SandboxResult(
            bytes(kept[0]).decode(errors="replace"),
            bytes(kept[1]).decode(errors="replace"),
            None if timed_out else returncode,
            timed_out,
            time.monotonic() - start,
            _read_report(report_r),
        )
    finally:
        for fd in (report_r, status_r):
            if fd is not None:
                os.close(fd)
        await _remove(workdir)


async def _remove(workdir: str) -> None:
    """Remove the work directory in a thread, waiting at most ``CLEANUP_TIMEOUT_S``."""
    removal = asyncio.ensure_future(asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(removal), CLEANUP_TIMEOUT_S)


@TOOLS.register("python")
class PythonTool(Tool):
    """Runs Python code in the sandbox; returns its stdout (or the error)."""

    name = "python"
    description = "Run Python code in a sandbox and return what it prints."
    parameters: dict[str, Any] = {  # noqa: RUF012
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(
        self, sandbox: SandboxConfig | dict[str, Any] | None = None, max_result_chars: int = 500
    ) -> None:
        self.sandbox = (
            SandboxConfig(**sandbox) if isinstance(sandbox, dict) else (sandbox or SandboxConfig())
        )
        self.max_result_chars = max_result_chars
        sandbox_backend(self.sandbox)  # a required but unusable bubblewrap fails here, not per call
        super().__init__(timeout_s=self.sandbox.wall_timeout_s + 5.0)

    async def execute(self, arguments: dict[str, Any]) -> str:
        r = await run_python(arguments["code"], self.sandbox)
        if r.ok:
            return r.stdout.strip()[: self.max_result_chars]
        if r.killed_by:
            return f"error: killed ({r.killed_by})"
        last = r.stderr.strip().splitlines()[-1:] or [f"exit status {r.returncode}"]
        return f"error: {last[0]}"[: self.max_result_chars]
