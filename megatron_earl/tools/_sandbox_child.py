"""Bootstrap of a sandboxed run (``tools.sandbox``): runs in the child as ``python -I -c``
before the user code, stdlib only. Not imported by the package.

Processes: this bootstrap B unshares the network and PID namespaces (``netns``, ``pidns``) and
forks R, PID 1 of the new PID namespace; R applies the uid drop and rlimits, reports the layers
applied on the report pipe (closed before any user code runs: the code cannot forge or block
it), forks U, which installs the audit hook and runs ``main.py`` as ``__main__``. R waits for U
and passes U's wait status to B on the status pipe; B ends the same way U did (exit status, or
the same signal). When R ends -- after U, or when the parent kills the process group -- the
kernel kills every process left in the namespace, including any that left the process group
with ``setsid``. Without a PID namespace B runs U's part itself (no R, no status pipe).
"""

import json
import os
import resource
import signal
import sys
import sysconfig


def main() -> None:
    cfg = json.loads(sys.argv[1])
    work = os.path.realpath(cfg["workdir"])
    applied = []
    report, status_r = cfg["report_fd"], None

    if cfg["net_namespace"] or cfg["pid_namespace"]:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _user = 0 if os.geteuid() == 0 else 0x10000000  # CLONE_NEWUSER when unprivileged
        for flag, name, wanted in (
            (0x40000000, "netns", cfg["net_namespace"]),
            (0x20000000, "pidns", cfg["pid_namespace"]),
        ):
            if wanted and _libc.unshare(flag | _user) == 0:
                applied.append(name)
                _user = 0  # one user namespace is enough
        del _libc

    if "pidns" in applied:
        status_r, status_w = os.pipe()
        if os.fork() != 0:  # B: wait for R's report of U's end and end the same way
            os.close(status_w)
            os.close(report)
            raw = b""
            while chunk := os.read(status_r, 64):
                raw += chunk
            try:
                status = int(raw)
            except ValueError:  # R died before it could report: killed with the group
                os._exit(137)
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
                os._exit(128 + sig)  # a signal whose default action does not end a process
            os._exit(os.waitstatus_to_exitcode(status))
        os.close(status_r)
        status_r = status_w  # R keeps the write end

    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        applied.append("uid")

    os.chdir(work)
    _limits = [
        (resource.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1)),
        (resource.RLIMIT_AS, (cfg["memory"], cfg["memory"])),
        (resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"])),
        (resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if cfg["nproc"] is not None:
        _limits.append((resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"])))
    for _res, _lim in _limits:
        resource.setrlimit(_res, _lim)
    applied.append("rlimits")
    applied.append("nproc" if cfg["nproc"] is not None else "no-nproc")

    if cfg["audit"]:
        _READ = [work, "/dev/null", "/dev/urandom", "/dev/random"]
        _READ += [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)]
        _READ += [os.path.realpath(p) for p in sysconfig.get_paths().values()]
        _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
        _PATH_EVENTS = {
            "os.remove": 1,
            "os.rename": 2,
            "os.mkdir": 1,
            "os.rmdir": 1,
            "os.chmod": 1,
            "os.chown": 1,
            "os.symlink": 2,
            "os.link": 2,
            "os.truncate": 1,
            "os.utime": 1,
            "shutil.rmtree": 1,
            "shutil.copyfile": 2,
            "shutil.move": 2,
            "os.mkfifo": 1,
            "os.mknod": 1,
        }
        _BLOCKED = (
            "os.exec",
            "os.posix_spawn",
            "os.spawn",
            "os.system",
            "subprocess.Popen",
            "ctypes.dlopen",
            "ctypes.dlsym",
            "os.forkpty",
            "pty.spawn",
            "os.startfile",
        )
        if cfg["nproc"] is None:
            _BLOCKED += ("os.fork",)
        if cfg["audit_network"]:
            _BLOCKED += (
                "socket.__new__",
                "socket.connect",
                "socket.bind",
                "socket.getaddrinfo",
                "socket.sendto",
                "socket.gethostbyname",
            )

        def _inside(path, roots):
            if isinstance(path, int) or path is None:
                return True
            p = os.path.realpath(os.fsdecode(path))
            return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)

        def _hook(event, args, _blocked=_BLOCKED, _inside=_inside, _work=(work,), _read=_READ):
            if event == "open":
                path, mode, flags = args
                write = bool(flags & _WRITE_FLAGS) or (
                    isinstance(mode, str) and any(c in mode for c in "wax+")
                )
                if not _inside(path, _work if write else _read):
                    what = "write" if write else "read"
                    raise PermissionError(f"sandbox: {what} outside {_work[0]} refused: {path}")
            elif event in _PATH_EVENTS:
                for path in args[: _PATH_EVENTS[event]]:
                    if not _inside(path, _work):
                        raise PermissionError(
                            f"sandbox: {event} outside {_work[0]} refused: {path}"
                        )
            elif event in ("os.listdir", "os.scandir"):
                if args and not _inside(args[0], _read):
                    raise PermissionError(f"sandbox: listing outside {_work[0]} refused: {args[0]}")
            elif event.startswith(_blocked):
                raise PermissionError(f"sandbox: {event} refused")

        applied.append("audit")
    else:
        _hook = None

    os.write(report, json.dumps(applied).encode())
    os.close(report)
    if status_r is not None:  # R: run U and report how it ended
        pid = os.fork()
        if pid != 0:
            while True:
                try:
                    _, status = os.waitpid(pid, 0)
                    break
                except InterruptedError:
                    continue
            os.write(status_r, str(status).encode())
            os._exit(0)
        os.close(status_r)
    if _hook is not None:
        sys.addaudithook(_hook)
    del cfg, applied
    with open(os.path.join(work, "main.py")) as _f:
        _code = compile(_f.read(), "main.py", "exec")
    del _f
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
