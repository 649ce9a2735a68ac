"""A TP rank > 0 of ``megatron-earl serve --tp-size N``: started by rank 0's ``serve.tp.Followers``
with the server's own arguments, never by hand.

    python -m megatron_earl.rollout.serve.follower <the arguments of megatron-earl serve>

It builds the engine as rank 0 does (``server.build_engine``) and runs ``EmbeddedEngine.follow()``
until rank 0 shuts the engine down; it ignores SIGINT and SIGTERM and dies with rank 0
(``serve.tp``'s docstring, "Lifetime"). The entry point lives here, above ``server``, so that
``serve.tp`` (which ``server`` imports) does not import ``server``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence

from megatron_earl.compat.processes import die_with_parent, skip_exit_gc
from megatron_earl.rollout.serve.server import build_engine, parse_args
from megatron_earl.rollout.serve.tp import FOLLOWER_MODULE, PARENT_ENV


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when rank 0 dies (Linux), and exit when its pipe closes (anywhere)."""
    die_with_parent(signal.SIGKILL, parent)  # exits if rank 0 died before the prctl

    def watch() -> None:
        while os.read(0, 1 << 12):  # the raw fd: no buffered-reader lock at shutdown
            pass
        os._exit(1)

    threading.Thread(target=watch, name="serve-tp-parent", daemon=True).start()


def follower_main(argv: Sequence[str] | None = None) -> int:
    """A TP rank > 0 of ``serve --tp-size N`` (started by ``Followers``, never by hand)."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None:
        raise SystemExit(
            f"{FOLLOWER_MODULE} is a follower of 'megatron-earl serve --tp-size N' "
            f"({PARENT_ENV} unset); start the server with megatron-earl serve"
        )
    _die_with_parent(int(parent))
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 stops the followers
        signal.signal(sig, signal.SIG_IGN)
    engine, _ = build_engine(parse_args(argv))
    engine.follow()
    return 0


if __name__ == "__main__":
    # ``call`` steps pickled by rank 0 name ``megatron_earl.rollout.serve.tp._join_rank`` ...:
    # imported above by name, so they find the same registry here.
    skip_exit_gc()
    sys.exit(follower_main(sys.argv[1:]))
