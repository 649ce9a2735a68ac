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

Under bubblewrap (``cfg["applied"]`` lists the layers bwrap enforces) the namespaces exist
already and this bootstrap is PID 1 of the PID namespace (``--as-pid-1``): it is R from the start,
with no B, and reports U's wait status on the status pipe ``cfg["status_fd"]`` to the parent.
"""

import json
import os
import resource
import signal
import sys
import sysconfig

_FUNCTION = type(lambda: None)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    work = os.path.realpath(cfg["workdir"])
    applied = list(cfg["applied"])  # layers the launcher (bwrap) enforces
    report, status_r = cfg["report_fd"], cfg["status_fd"]
    own_pidns = False

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
                own_pidns = own_pidns or name == "pidns"
                _user = 0  # one user namespace is enough
        del _libc

    if own_pidns:
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
        # event -> how many leading arguments are paths that must lie in the work directory
        _PATH_EVENTS = (
            ("os.remove", 1),
            ("os.rename", 2),
            ("os.mkdir", 1),
            ("os.rmdir", 1),
            ("os.chmod", 1),
            ("os.chown", 1),
            ("os.symlink", 2),
            ("os.link", 2),
            ("os.truncate", 1),
            ("os.utime", 1),
            ("shutil.rmtree", 1),
            ("shutil.copyfile", 2),
            ("shutil.move", 2),
            ("os.mkfifo", 1),
            ("os.mknod", 1),
        )
        _BLOCKED = (
            "os.exec",
            "os.posix_spawn",
            "os.spawn",
            "os.system",
            "subprocess.Popen",
            "ctypes.",  # every ctypes event: raw memory access could rewrite the hook
            "os.forkpty",
            "pty.spawn",
            "os.startfile",
            "gc.get_objects",  # introspection that would reach the hook's state
            "gc.get_referrers",
            "gc.get_referents",
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

        # Everything the hook uses is bound now, as defaults of immutable values: the code
        # cannot reconfigure it by rebinding a module attribute (os.path.realpath), a builtin
        # (any, isinstance) or a closure cell; rebinding the hook's own code or defaults is an
        # audited event it refuses.
        def _hook(
            event,
            args,
            _blocked=_BLOCKED,
            _paths=dict(_PATH_EVENTS).get,
            _work=(work,),
            _read=tuple(_READ),
            _write_flags=_WRITE_FLAGS,
            _realpath=os.path.realpath,
            _fspath=os.fspath,
            _any=any,
            _bool=bool,
            _bytes=bytes,
            _str=str,
            _int=int,
            _type=type,
            _function=_FUNCTION,
            _error=PermissionError,
            _code_attrs=("__code__", "__defaults__", "__kwdefaults__", "__globals__"),
        ):
            def inside(path, roots):
                if path is None or _type(path) is _int:
                    return True
                path = _fspath(path)
                if _type(path) is _bytes:
                    path = path.decode("utf-8", "surrogateescape")
                p = _realpath(path)
                return _any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)

            if event == "open":
                path, mode, flags = args
                write = _bool(flags & _write_flags) or (
                    _type(mode) is _str and _any(c in mode for c in "wax+")
                )
                if not inside(path, _work if write else _read):
                    what = "write" if write else "read"
                    raise _error(f"sandbox: {what} outside {_work[0]} refused: {path}")
            elif (count := _paths(event)) is not None:
                for path in args[:count]:
                    if not inside(path, _work):
                        raise _error(f"sandbox: {event} outside {_work[0]} refused: {path}")
            elif event in ("os.listdir", "os.scandir"):
                if args and not inside(args[0], _read):
                    raise _error(f"sandbox: listing outside {_work[0]} refused: {args[0]}")
            elif event == "object.__setattr__":
                if _type(args[0]) is _function and args[1] in _code_attrs:
                    raise _error(f"sandbox: setting a function's {args[1]} refused")
            elif event.startswith(_blocked):
                raise _error(f"sandbox: {event} refused")

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
