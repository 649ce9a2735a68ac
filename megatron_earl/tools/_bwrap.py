"""The ``bwrap`` backend of the Python sandbox (``tools.sandbox``): bubblewrap's command line for
one run, and a probe, run once per (bwrap, interpreter, user) and cached, that says whether it
works on this machine.

bubblewrap (Debian/Ubuntu/Fedora package ``bubblewrap``; ``scripts/install_system_deps.sh``) builds
the sandbox with kernel namespaces: a new mount namespace whose root is an empty tmpfs holding only
what the command line binds -- ``/usr`` and the interpreter's installation read-only, the work
directory read-write, a private ``/proc`` and ``/dev``, an empty ``/tmp`` -- and new user, PID,
network, IPC and UTS namespaces. It drops every capability and sets ``no_new_privs`` (set-uid
binaries do not raise privileges). ``--as-pid-1`` makes the bootstrap (``_sandbox_child.py``) PID 1
of the namespace, so when it ends the kernel kills every process left; ``--die-with-parent`` ends it
when bwrap's monitor process (the one ``run_python`` starts and kills) dies; ``--new-session``
keeps the code off the caller's terminal.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

PACKAGE = "bubblewrap"
"""Distribution package that provides ``bwrap``."""
PROBE_TIMEOUT_S = 20.0
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Top-level directories that are symlinks into /usr on merged-/usr systems (bound otherwise)."""
_PREFIXES = (
    "import json, sys; "
    "print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
)


@dataclass(frozen=True)
class Probe:
    """Whether bwrap runs the interpreter here, and what it needs bound."""

    bwrap: str | None
    """Path of a working ``bwrap``; None when it is missing or does not work."""
    binds: tuple[str, ...] = ()
    """Directories bound read-only: /usr and the interpreter's installation."""
    reason: str = ""
    """Why ``bwrap`` is None."""

    @property
    def backend(self) -> str:
        """``"bwrap"`` when it works, else ``"native"``."""
        return "native" if self.bwrap is None else "bwrap"


def command(bwrap: str, binds: tuple[str, ...], workdir: str | None) -> list[str]:
    """bwrap's arguments up to the program to run (which follows them)."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1"]
    for path in binds:
        argv += ["--ro-bind", path, path]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path) and not _under(path, binds):
            argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if workdir is not None:
        argv += ["--bind", workdir, workdir, "--chdir", workdir]
    return argv


def _under(path: str, roots: tuple[str, ...] | list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _binds(python: str) -> tuple[str, ...]:
    """/usr and the interpreter's installation (prefixes, venv, real executable's directory),
    outermost directories only."""
    out = subprocess.run(
        [python, "-I", "-c", _PREFIXES], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
    )
    if out.returncode != 0:
        raise RuntimeError(f"{python} -I failed: {out.stderr.strip()[-300:]}")
    paths = {"/usr", os.path.dirname(python), os.path.dirname(os.path.realpath(python))}
    for prefix in json.loads(out.stdout):
        paths |= {prefix, os.path.realpath(prefix)}
    kept: list[str] = []
    for path in sorted(paths, key=len):
        if not _under(path, kept):
            kept.append(path)
    return tuple(kept)


def probe(bwrap: str, python: str, user: tuple[int, int] | None) -> Probe:
    """Run ``python -I`` under ``bwrap`` (looked up on PATH when not a path) as ``user``
    ((uid, gid); None: this process's user) with a bound work directory; cached per bwrap
    executable, interpreter and user."""
    found = shutil.which(bwrap)
    if found is None:
        return Probe(None, reason=f"{bwrap!r} not found (PATH={os.environ.get('PATH', '')!r})")
    return _probe(os.path.realpath(found), python, user)


@functools.cache
def _probe(found: str, python: str, user: tuple[int, int] | None) -> Probe:
    try:
        binds = _binds(python)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
        return Probe(None, reason=f"cannot inspect the interpreter {python!r}: {e}")
    workdir = tempfile.mkdtemp(prefix="earl-bwrap-probe-")
    try:
        if user is not None:
            os.chown(workdir, *user)
        argv = [*command(found, binds, workdir), python, "-I", "-c", "print('ok')"]
        try:
            out = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                **as_user(user),
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return Probe(None, reason=f"{found} failed to start: {e}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if out.returncode != 0 or out.stdout.strip() != "ok":
        detail = (out.stderr.strip() or out.stdout.strip())[-300:]
        return Probe(None, reason=f"{found} does not work here (exit {out.returncode}): {detail}")
    return Probe(found, binds)


def as_user(user: tuple[int, int] | None) -> dict:
    """``subprocess`` arguments that start a program as ``user`` (no supplementary groups)."""
    if user is None:
        return {}
    return {"user": user[0], "group": user[1], "extra_groups": []}
