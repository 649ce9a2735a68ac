"""The bubblewrap backend of the Python sandbox: what the kernel enforces, with the audit hook off
(so these hold for code that gets past the hook: a stdlib module it does not see, native code),
results read back through bwrap, and the choice of backend (``auto`` falls back to ``native``;
``bwrap`` required but unusable is a clear error).

The tests that need a working bubblewrap skip, with the reason, where it is missing or unusable
(scripts/install_system_deps.sh installs it; it needs user namespaces).

Run: python -m pytest -q -p no:warnings tests/integration/test_sandbox_bwrap.py   (~15 s)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import tempfile
import uuid
from pathlib import Path

import pytest

from megatron_earl.tools import (
    PythonTool,
    SandboxBackend,
    SandboxConfig,
    SandboxUnavailableError,
    _bwrap,
    run_python,
    sandbox_backend,
)
from megatron_earl.tools.sandbox import _interpreter
from tests.integration.test_sandbox import _accepted, _bounded

REPO = Path(__file__).resolve().parents[2]


def bwrap(code: str, **limits) -> object:
    """``code`` under bubblewrap with the audit hook off (the kernel's layers alone)."""
    r = asyncio.run(run_python(code, SandboxConfig(backend="bwrap", audit_hook=False, **limits)))
    assert r.isolation[:2] == ["bwrap", "mountns"] and "audit" not in r.isolation, r
    return r


@pytest.fixture
def probe() -> _bwrap.Probe:
    """The default config's bubblewrap probe; skips, with the reason, when it is unusable."""
    config = SandboxConfig()
    python, use_uid = _interpreter(config, os.geteuid() == 0 and config.drop_privileges)
    entry = pwd.getpwnam(config.sandbox_user)
    found = _bwrap.probe(config.bwrap, python, (entry.pw_uid, entry.pw_gid) if use_uid else None)
    if found.bwrap is None:
        pytest.skip(
            f"bubblewrap unusable here: {found.reason} (scripts/install_system_deps.sh installs "
            "the 'bubblewrap' package with apt-get: apt unreachable, not root, or no user "
            "namespaces?)"
        )
    return found


def _probe_all(checks: dict[str, str]) -> str:
    """Code that runs each statement and prints {name: "ok" or the exception's type}."""
    lines = ["import json, os, subprocess", "out = {}"]
    for name, stmt in checks.items():
        lines += [
            "try:",
            f"    {stmt}",
            f"    out[{name!r}] = 'ok'",
            "except Exception as e:",
            f"    out[{name!r}] = type(e).__name__",
        ]
    return "\n".join([*lines, "print(json.dumps(out))"])


def test_hides_the_file_system(probe):
    repo_file = REPO / "README.md"
    r = bwrap(
        _probe_all(
            {
                "passwd": "open('/etc/passwd').read()",
                "root": "os.listdir('/root')",
                "repo": f"open({str(repo_file)!r}).read()",
                "repo_dir": f"os.stat({str(REPO)!r})",
                "cat_passwd": "assert subprocess.run(['/usr/bin/cat', '/etc/passwd'])"
                ".returncode == 0",
                "own_dir": "open('mine.txt', 'w').write('x'); open('mine.txt').read()",
            }
        )
    )
    assert r.ok, r.stderr
    seen = json.loads(r.stdout)
    assert seen == {
        "passwd": "FileNotFoundError",
        "root": "FileNotFoundError",
        "repo": "FileNotFoundError",
        "repo_dir": "FileNotFoundError",
        "cat_passwd": "AssertionError",  # the binary runs, and sees what the code sees
        "own_dir": "ok",
    }, seen
    r = bwrap("import os, json; print(json.dumps(sorted(os.listdir('/'))))")
    visible = set(json.loads(r.stdout))
    allowed = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "tmp"}
    allowed |= {Path(p).parts[1] for p in (*probe.binds, tempfile.gettempdir())}
    assert visible <= allowed and "etc" not in visible and "root" not in visible, visible


def test_cannot_write_outside_the_work_dir(probe, shared_dir):
    """A world-writable host directory, the host's /tmp, /usr: a direct write and one by a binary
    (``/usr/bin/touch``, as a spawn the hook would not see through ``_posixsubprocess``)."""
    tag = uuid.uuid4().hex
    targets = {
        "shared": shared_dir / f"a-{tag}",
        "host_tmp": Path("/tmp") / f"earl-escape-{tag}",
        "usr": Path("/usr") / f"earl-escape-{tag}",
    }
    checks = {f"open_{k}": f"open({str(p)!r}, 'w').write('x')" for k, p in targets.items()}
    checks |= {
        f"touch_{k}": f"assert subprocess.run(['/usr/bin/touch', {str(p) + '-t'!r}])"
        ".returncode == 0"
        for k, p in targets.items()
    }
    try:
        r = bwrap(_probe_all(checks))
        assert r.ok, r.stderr
        seen = json.loads(r.stdout)
        leaked = [q for p in targets.values() for q in (p, Path(f"{p}-t")) if q.exists()]
        assert not leaked, (leaked, seen)
        assert seen["open_usr"] in ("OSError", "PermissionError"), seen  # read-only bind
        assert seen["open_host_tmp"] == "ok", seen  # the private tmpfs /tmp, not the host's
    finally:
        for p in targets.values():
            for q in (p, Path(f"{p}-t")):
                q.unlink(missing_ok=True)


def test_no_network(probe, listener):
    port = listener.getsockname()[1]
    r = bwrap(
        f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)",
        audit_network=False,
    )
    assert r.returncode == 1, r.stderr
    assert "ConnectionRefusedError" in r.stderr or "unreachable" in r.stderr, r.stderr
    assert not _accepted(listener)
    r = bwrap("import socket; print(socket.getaddrinfo('example.com', 80))")
    assert r.returncode == 1 and "gaierror" in r.stderr, r.stderr


SETSID_GRANDCHILD = (
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        while True:\n"
    "            time.sleep(0.05)\n"
    "    os._exit(0)\n"
    "time.sleep(0.3)\n"
    "print('parent done', flush=True)\n"
)


@pytest.mark.parametrize("ends", ["on_its_own", "at_the_timeout"])
def test_no_process_outlives_the_call(probe, ends):
    code = SETSID_GRANDCHILD + ("time.sleep(60)\n" if ends == "at_the_timeout" else "")
    r, took, left = _bounded(
        code, limit_s=15, wall_timeout_s=2, backend="bwrap", audit_hook=False, max_processes=8
    )
    assert "parent done" in r.stdout, (r.stdout, r.stderr)
    assert r.timed_out == (ends == "at_the_timeout") and took < 2 + 2, (r, took)
    assert not left, f"sandboxed processes outlived the call: {left}"


def test_results_are_read_back(probe):
    r = bwrap("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    assert (r.stdout, r.stderr, r.returncode, r.killed_by) == ("out\n", "err\n", 3, None)
    r = bwrap("import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert r.returncode == -15 and r.killed_by == "SIGTERM", r
    r = bwrap("import time; time.sleep(60)", wall_timeout_s=1)
    assert r.timed_out and r.returncode is None and r.killed_by == "wall_timeout" and r.wall_s < 4
    r = bwrap("while True:\n    pass\n", cpu_time_s=1, wall_timeout_s=20)
    assert r.killed_by == "cpu_limit" and r.wall_s < 10, r
    r = bwrap("x = bytearray(1 << 30)", memory_mb=256)
    assert r.returncode == 1 and "MemoryError" in r.stderr, r.stderr
    r = bwrap("print('x' * 100_000)", max_output_bytes=1000)
    assert r.ok and r.stdout == "x" * 1000
    r = asyncio.run(run_python("print(6 * 7)"))  # default config: auto picks bubblewrap here
    assert r.ok and r.stdout == "42\n" and r.isolation[0] == "bwrap", r
    assert {"mountns", "netns", "pidns", "rlimits", "audit"} <= set(r.isolation)
    if os.geteuid() == 0:
        assert {"uid", "nproc"} <= set(r.isolation)


@pytest.mark.parametrize("bwrap_exe", ["/nonexistent/bwrap", "/bin/false", "on an empty PATH"])
def test_required_bwrap_unusable_is_a_clear_error(bwrap_exe, tmp_path, monkeypatch):
    if bwrap_exe == "on an empty PATH":
        monkeypatch.setenv("PATH", str(tmp_path))
        bwrap_exe = "bwrap"
    config = SandboxConfig(backend="bwrap", bwrap=bwrap_exe)
    with pytest.raises(SandboxUnavailableError) as err:
        asyncio.run(run_python("print(1)", config))
    message = str(err.value)
    assert ("backend='bwrap'" in message and repr(bwrap_exe) in message) or bwrap_exe in message
    assert "'bubblewrap'" in message and "install_system_deps.sh" in message, message


def test_auto_falls_back_to_native_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_earl.tools.sandbox"):
        r = asyncio.run(run_python("print(1)", SandboxConfig(bwrap="/nonexistent/bwrap-auto")))
    assert r.ok and r.isolation[0] == "native", r
    assert "bwrap" not in r.isolation and "mountns" not in r.isolation
    assert "/nonexistent/bwrap-auto" in caplog.text and "not a security boundary" in caplog.text


def test_backend_value_is_checked():
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'bwrap', 'native'\]"):
        SandboxConfig(backend="nsjail")


def test_python_tool_checks_its_backend_at_construction():
    with pytest.raises(SandboxUnavailableError, match="/nonexistent/bwrap-tool"):
        PythonTool({"backend": "bwrap", "bwrap": "/nonexistent/bwrap-tool"})
    assert sandbox_backend(SandboxConfig(backend="native")) is SandboxBackend.NATIVE
