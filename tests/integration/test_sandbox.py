"""The Python sandbox refuses a network connection, writes outside its directory, a fork bomb
and a memory hog, each within its limits; CPU and wall limits kill runaway code.

Run: python -m pytest -q -p no:warnings tests/integration/test_sandbox.py   (~15 s)
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_earl.tools import PythonTool, SandboxConfig, run_python


def sandbox(code: str, **limits) -> object:
    return asyncio.run(run_python(code, SandboxConfig(**limits)))


def test_runs_code_with_isolation_layers():
    r = sandbox("import os, json; print(json.dumps([os.getcwd().startswith('/tmp'), 6*7]))")
    assert r.ok and r.stdout.strip() == "[true, 42]", r.stderr
    assert {"rlimits", "audit"} <= set(r.isolation)
    if os.geteuid() == 0:
        assert {"netns", "uid", "nproc"} <= set(r.isolation), r.isolation


def _accepted(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except TimeoutError:
        return False


def test_refuses_network(listener):
    port = listener.getsockname()[1]
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
    r = sandbox(code)
    assert r.returncode == 1 and "PermissionError: sandbox: socket" in r.stderr, r.stderr
    # The kernel layer alone (audit hook off for sockets): a fresh network namespace. (Under
    # bubblewrap, whose loopback is up, in tests/integration/test_sandbox_bwrap.py.)
    r = sandbox(code, audit_network=False, backend="native")
    if "netns" not in r.isolation:
        pytest.skip("network namespaces unavailable here; only the audit-hook layer applies")
    assert r.returncode == 1 and "Network is unreachable" in r.stderr, r.stderr
    assert not _accepted(listener)


def test_refuses_access_outside_its_directory(tmp_path):
    outside = tmp_path / "outside.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    r = sandbox(f"open({str(outside)!r}, 'w').write('x')")
    assert "PermissionError: sandbox: write outside" in r.stderr and not outside.exists()
    r = sandbox(f"import os; os.remove({str(victim)!r})")
    assert "os.remove outside" in r.stderr and victim.read_text() == "keep me"
    r = sandbox(f"import os; os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT)")
    assert "write outside" in r.stderr and not outside.exists()
    r = sandbox("print(open('/etc/hostname').read())")
    assert "read outside" in r.stderr
    r = sandbox("import subprocess; subprocess.run(['touch', '/tmp/x'])")
    assert "subprocess.Popen refused" in r.stderr
    r = sandbox("open('data.txt', 'w').write('inside'); print(open('data.txt').read())")
    assert r.ok and r.stdout.strip() == "inside"


def _sandbox_processes() -> list[psutil.Process]:
    """Living processes of any sandboxed run (the bootstrap's argument names its work directory;
    forked children keep the command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
            "earl-sandbox-" in a for a in cmdline
        ):
            found.append(proc)
    return found


def test_fork_bomb_is_contained():
    code = (
        "import os, time\n"
        "pids = []\n"
        "try:\n"
        "    for _ in range(10000):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            time.sleep(60); os._exit(0)\n"
        "        pids.append(pid)\n"
        "except (OSError, PermissionError) as e:\n"
        "    print('refused after', len(pids), type(e).__name__, flush=True)\n"
        "print(' '.join(map(str, pids)))\n"
    )
    start = time.monotonic()
    r = sandbox(code, max_processes=8, wall_timeout_s=10)
    assert time.monotonic() - start < 10, "the main process should end on its own"
    first = r.stdout.splitlines()[0] if r.stdout else ""
    assert first.startswith("refused after"), (r.stdout, r.stderr)
    assert int(first.split()[2]) <= 8
    time.sleep(0.2)
    assert not _sandbox_processes(), "children survived the sandbox"


def test_recursive_fork_bomb_is_killed():
    start = time.monotonic()
    r = sandbox(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        max_processes=8,
        wall_timeout_s=3,
        cpu_time_s=2,
    )
    assert time.monotonic() - start < 8
    assert r.killed_by in ("wall_timeout", "cpu_limit")
    if "uid" in r.isolation:
        time.sleep(0.2)
        left = [
            p
            for p in psutil.process_iter(["uids", "status"])
            if p.info["uids"].real == 65534 and p.info["status"] != psutil.STATUS_ZOMBIE
        ]
        assert not left, f"sandbox processes left: {left}"


def test_memory_hog_is_refused():
    start = time.monotonic()
    r = sandbox("x = bytearray(4 * 2**30)", memory_mb=256)
    assert "MemoryError" in r.stderr and r.returncode == 1
    r = sandbox(
        "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))\n", memory_mb=256
    )
    assert "MemoryError" in r.stderr and r.returncode == 1
    assert time.monotonic() - start < 10


def test_cpu_and_wall_limits():
    r = sandbox("while True:\n    pass\n", cpu_time_s=1, wall_timeout_s=30)
    assert r.killed_by == "cpu_limit" and r.wall_s < 30
    r = sandbox("import time; time.sleep(60)", wall_timeout_s=1)
    assert r.timed_out and r.killed_by == "wall_timeout" and r.wall_s < 5


def test_python_tool():
    tool = PythonTool({"wall_timeout_s": 5})
    assert asyncio.run(tool.execute({"code": "print(sum(i*i for i in range(1, 8)))"})) == "140"
    assert (
        asyncio.run(tool.execute({"code": "1/0"})) == "error: ZeroDivisionError: division by zero"
    )
    assert tool.validate({"code": 1}) is not None


def _bounded(code: str, limit_s: float, **limits) -> tuple[object, float, list]:
    """``sandbox(code)`` in a daemon thread: the result, how long the call took and the sandbox
    processes still alive 1 s after it returned (then killed); a failure when the call has not
    returned after ``limit_s`` (a caller frozen by the code)."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(sandbox(code, **limits)), daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(limit_s)
    took = time.monotonic() - start
    settle = time.monotonic() + 1.0  # the kernel tears a PID namespace down asynchronously
    while (left := _sandbox_processes()) and time.monotonic() < settle:
        time.sleep(0.05)
    for proc in left:
        proc.kill()
    assert box, f"run_python did not return within {limit_s}s: the code froze its caller"
    return box[0], took, left


def test_files_left_by_the_code_cannot_block_the_caller():
    # Named pipes where the parent used to read results back (.isolation.json) and over the
    # code's own main.py: reading any of them would block until a writer appears.
    code = (
        "import os\n"
        "for name in ('.isolation.json', 'main.py', 'out.txt'):\n"
        "    if os.path.exists(name):\n"
        "        os.remove(name)\n"
        "    os.mkfifo(name)\n"
        "print('planted')\n"
    )
    r, took, _ = _bounded(code, limit_s=15, wall_timeout_s=3)
    assert r.ok and r.stdout.strip() == "planted", r.stderr
    assert {"rlimits", "audit"} <= set(r.isolation), r.isolation
    assert took < 3 + 5


def test_no_process_outlives_the_call(shared_dir):
    # Native backend (bubblewrap: test_sandbox_bwrap.py). A grandchild that leaves the process
    # group (setsid), keeps stdout open and writes a heartbeat outside the work directory (audit
    # hook off: the kernel layers alone).
    beat = shared_dir / "beat"
    beat.touch()
    beat.chmod(0o666)
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        f"            open({str(beat)!r}, 'a').write('.')\n"
        "            time.sleep(0.05)\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('parent done')\n"
    )
    r, took, left = _bounded(code, limit_s=15, wall_timeout_s=5, audit_hook=False, backend="native")
    if "pidns" not in r.isolation and os.geteuid() != 0:
        pytest.skip("PID namespaces unavailable here: a setsid process can outlive the call")
    assert r.ok and "parent done" in r.stdout and took < 5, (r.stdout, r.stderr, took)
    size = beat.stat().st_size
    assert size > 0, "the grandchild never ran"
    time.sleep(0.3)
    assert beat.stat().st_size == size, "a sandboxed process outlived the call"
    assert not left, f"sandboxed processes outlived the call: {left}"


HOOK_ATTACKS = {
    "rebind the hook's defaults": (
        "import gc\n"
        "hook = [o for o in gc.get_objects() if getattr(o, '__name__', '') == '_hook'][0]\n"
        "hook.__defaults__ = tuple(() for _ in hook.__defaults__)\n"
    ),
    "rebind realpath": "import os.path\nos.path.realpath = lambda p: '/tmp'\n",
    "rebind builtins": (
        "import builtins\nbuiltins.any = lambda it: True\nbuiltins.isinstance = lambda *a: True\n"
    ),
    "rebind a function's code": (
        "import sys\nframe = sys._getframe(1)\n"
        "for f in frame.f_locals.values():\n"
        "    if callable(f) and getattr(f, '__name__', '') == '_hook':\n"
        "        f.__code__ = (lambda e, a: None).__code__\n"
    ),
}


@pytest.mark.parametrize("attack", HOOK_ATTACKS)
def test_code_cannot_reconfigure_the_audit_hook(attack):
    """After each attempt the hook still refuses a read outside the work directory (a file the
    sandbox user may read as far as the kernel is concerned: only the hook stops it). Poisoned
    builtins can make the hook fail with another error than its own -- the read fails either
    way, and nothing of the file comes out."""
    code = (
        "try:\n"
        + "".join("    " + line + "\n" for line in HOOK_ATTACKS[attack].splitlines())
        + "except Exception as e:\n    print('attack refused:', type(e).__name__)\n"
    )
    code += "print(open('/etc/hostname').read())\n"
    r = sandbox(code, backend="native")  # bubblewrap would hide the file: the hook alone here
    secret = Path("/etc/hostname").read_text().strip()
    assert r.returncode == 1 and secret not in r.stdout, (r.stdout, r.stderr)
    if attack != "rebind builtins":
        assert "PermissionError: sandbox: read outside" in r.stderr, (r.stdout, r.stderr)


def test_returns_in_time_without_a_pid_namespace():
    """Without the PID namespace a setsid grandchild escapes the kill and holds the output pipes
    open; the call still returns within the wall timeout plus the read grace."""
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(20)\n"
        "    os._exit(0)\n"
        "time.sleep(30)\n"
    )
    r, took, _ = _bounded(code, limit_s=15, wall_timeout_s=1, pid_namespace=False, backend="native")
    assert r.timed_out and "pidns" not in r.isolation
    assert took < 1 + 1 + 2, took
