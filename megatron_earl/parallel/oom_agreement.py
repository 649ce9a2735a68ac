"""An out-of-memory on any rank, agreed by every rank: the flag under the selector's OOM recovery.

    with oom_attempt():                  # selector.oom.run_phase_with_recovery, per attempt
        try:
            phase_fn(data, layout)       # calls agreement_point() where every rank passes
            oom = agree_oom(False)       # after the body: the last agreement of the attempt
        except PeerOutOfMemory:          # another rank ran out: already agreed at a point
            oom = True
        except torch.OutOfMemoryError:   # this rank ran out: join the next agreement
            oom = agree_oom(True)

A CUDA OOM is raised on one rank only; the others go on into the phase's next collective. So an
OOM becomes a flag agreed by one small all-reduce (MAX of a 0/1 int, ``agree_oom``), and the
agreement is placed where the healthy ranks arrive too, not after the phase's end:

- **agreement points** inside the phase (``agreement_point``): every rank calls ``agree_oom(False)``
  there; when another rank has run out of memory the result is True and this rank raises
  ``PeerOutOfMemory`` (a ``torch.OutOfMemoryError``) at once, leaving the phase with no further
  collective. The points: before a train step's gradient reduction (the DDP finalize hook that
  ``training.setup.wire_schedule_hooks`` installs), so no rank steps its optimizer after an OOM
  elsewhere in the forward/backward; at the CPU budget's checkpoint (``MemoryBudget.checkpoint``:
  the end of a forward-only phase, and before ``optimizer.step``); after the experience phase's
  forward passes in the RL loop (``RLLoop.experience``); before the measured peak's all-reduce
  (``PhaseSelection._measure``); after the body (the recovery wrapper).
- **the failing rank** catches its OOM in the recovery wrapper and calls ``agree_oom(True)`` once:
  collectives on a group are matched by order, so that call meets the healthy ranks' next
  agreement point, wherever it is in their program.

Every rank makes the same number of agreement calls per attempt, so the next attempt starts in
step. Agreement points are no-ops outside ``oom_attempt`` (a run without recovery makes no extra
collective).

What this guarantees. An OOM raised on any set of ranks in a stretch of the phase after which the
other ranks' next collective with a failing rank is an agreement point: every rank raises, none
has applied an update, and the recovery re-runs on every rank. In practice:

- any OOM in the forward/backward compute of a train step, or in the forward of a forward-only
  phase, in a layout whose model-parallel groups have size 1 (tp = cp = pp = 1, any dp): the ranks
  compute alone until the gradient reduction / the end-of-phase check. Example (the test): rank 1
  runs out allocating an activation in its first micro-batch's forward while rank 0 finishes its
  forward/backward; rank 0 meets rank 1 at the agreement before the DP gradient all-reduce; no
  rank steps; both re-run the same data in the next layout;
- with tp, cp or pp > 1, when every rank of each model-parallel group the OOM's layer communicates
  on runs out at the same op (equal shapes on TP/CP ranks make this the common case, but nothing
  guarantees it);
- an OOM after the phase's last collective (caught by the agreement after the body).

What it does not guarantee. An OOM on one rank while its peers wait for it in another collective:
a TP all-reduce in forward (rank 0 of a tp2 group runs out allocating the attention output while
rank 1 is blocked in the row-parallel all-reduce), a CP attention all-gather, a PP send/recv, the
gradient all-reduce, the step's metric all-reduces, or ``optimizer.step`` itself (the update may
then be applied on some ranks only). The peers stay blocked in a device collective the failing
rank never joins: on gloo until the process-group timeout; on NCCL until ``ProcessGroupNCCL``'s
watchdog times the collective out and, under ``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default (3:
tear down without aborting the communicators; 1 aborts them first), ends the process. Resuming
instead would need the communicators aborted (mode 2, or ``ProcessGroupNCCL.abort()``) and every
communicator of the layout rebuilt: not implemented. And when the peers' next collective is
itself on the agreement's group (the host world group, which also carries the train step's
metric and finiteness all-reduces), the failing rank's agreement is matched with it by order:
gloo then raises or combines mismatched buffers. A group that carries nothing but agreements
would turn that case into a timeout as well (not done: one more gloo group per process for a
case that ends the run either way).

Which group: the flag is host metadata, so it goes over the gloo host world group
(``parallel.groups.host_group()``; on GPUs the world group is NCCL, which cannot move a host
tensor). Which ranks call: every rank of the world.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.distributed as dist

from megatron_earl.parallel.groups import host_group

_ATTEMPT: ContextVar[bool] = ContextVar("megatron_earl_oom_attempt", default=False)


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this phase (agreed at an ``agreement_point``)."""


def agreement_group() -> dist.ProcessGroup:
    """The group the OOM flag is agreed over: the host (gloo) world group."""
    return host_group()


def agree_oom(local_oom: bool) -> bool:
    """True on every rank when any rank ran out of memory (one all-reduce, MAX of a 0/1 int).

    Which ranks call: every rank of ``agreement_group()``, at matching agreements."""
    if not dist.is_initialized() or dist.get_world_size(agreement_group()) == 1:
        return local_oom
    flag = torch.tensor([int(local_oom)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=agreement_group())
    return bool(flag.item())


def agreement_point() -> None:
    """Inside a phase run under ``oom_attempt``: raise ``PeerOutOfMemory`` when another rank has
    run out of memory (``agree_oom(False)``); a no-op outside one.

    Which ranks call: every rank of ``agreement_group()`` (the same points, in the same order)."""
    if _ATTEMPT.get() and agree_oom(False):
        raise PeerOutOfMemory("another rank ran out of memory in this phase (agreed)")


@contextlib.contextmanager
def oom_attempt() -> Iterator[None]:
    """Make ``agreement_point`` active for one attempt of a phase (module docstring)."""
    token = _ATTEMPT.set(True)
    try:
        yield
    finally:
        _ATTEMPT.reset(token)
