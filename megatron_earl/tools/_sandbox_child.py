"""Bootstrap of a sandboxed run (``tools.sandbox``): runs in the child as ``python -I -c``
before the user code, stdlib only. Applies the isolation layers in order (network namespace,
uid drop, rlimits, audit hook), records which ones applied in ``.isolation.json``, then runs
``main.py`` of the work directory as ``__main__``. Not imported by the package."""

import json
import os
import resource
import sys
import sysconfig


def main() -> None:
    cfg = json.loads(sys.argv[1])
    work = os.path.realpath(cfg["workdir"])
    applied = []

    if cfg["net_namespace"]:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _flags = 0x40000000 if os.geteuid() == 0 else 0x40000000 | 0x10000000
        if _libc.unshare(_flags) == 0:
            applied.append("netns")
        del _libc

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

        with open(os.path.join(work, ".isolation.json"), "w") as _f:
            json.dump([*applied, "audit"], _f)
        sys.addaudithook(_hook)
    else:
        with open(os.path.join(work, ".isolation.json"), "w") as _f:
            json.dump(applied, _f)

    del cfg, applied
    with open(os.path.join(work, "main.py")) as _f:
        _code = compile(_f.read(), "main.py", "exec")
    del _f
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
