"""A graceful stop on SIGTERM / SIGINT (``checkpoint.on_signal``): the ranks finish the step,
save a checkpoint and leave the loop together.

    stop = StopSignal.install()              # every rank, before the loop
    ...
    if stop.agreed():                        # every rank, at every step boundary
        save(...); break

A signal only sets a flag (the handler runs between two bytecodes of the main thread: it must
not touch a collective). At each step boundary every rank all-reduces its flag (MAX over the
host world group), so all ranks stop at the same step even when the signal reached them at
different moments (``megatron-earl train`` signals the ranks one after another; slurm signals
every task).
"""

from __future__ import annotations

import signal
from typing import Any

import torch
import torch.distributed as dist

from megatron_earl.parallel.groups import host_group

SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that request a graceful stop."""


class StopSignal:
    """This rank's stop request (see the module docstring)."""

    def __init__(self) -> None:
        self.received: int = 0
        """The number of the signal received (0: none)."""
        self.stopped_by: str | None = None
        """The name of the signal the ranks agreed to stop on (after ``agreed``)."""

    @classmethod
    def install(cls) -> StopSignal:
        """Handle ``SIGNALS`` in this process from now on (main thread only). Local."""
        stop = cls()
        for sig in SIGNALS:
            signal.signal(sig, stop._handle)
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received:  # a second signal: stop now, as without on_signal
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.received = signum

    def agreed(self) -> bool:
        """Whether any rank has received a signal; the same answer on every rank. Which ranks
        call: every rank of the world, at the same step boundary (one all-reduce on the host
        world group)."""
        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group())
        if flag.item():
            self.stopped_by = signal.Signals(int(flag.item())).name
        return bool(flag.item())
