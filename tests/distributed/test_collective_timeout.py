"""One configured collective timeout on every process group (``runtime.collective_timeout_s``,
``runtime.initialize(timeout_s)``): a rank whose peer never joins a collective on one of the
groups Megatron builds for a layout, or on their host twins, fails after that timeout instead of
Megatron's 30 minutes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatron_earl.testing.distributed import run_distributed

TIMEOUT_S = 3


def _lonely_collectives(separate_host: bool, done: Path) -> list[tuple[str, float, str]]:
    """Rank 0 all-reduces on each of tp2's groups alone (rank 1 waits until rank 0 has created
    ``done``, then leaves); returns (group, seconds to fail, error) for each."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_earl.parallel.groups import forced_host_groups, host_group
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import destroy_layouts, use_layout

    out = []
    with forced_host_groups(separate_host):
        use_layout(ParallelLayout(tp=2))
        groups = {"tp": ps.get_tensor_model_parallel_group()}  # also Megatron's mp group here
        if separate_host:  # the twins are other groups (a timed-out gloo group stays broken)
            groups["tp host twin"] = host_group(ps.get_tensor_model_parallel_group())
        if dist.get_rank() == 0:
            for name, group in groups.items():
                start = time.monotonic()
                try:
                    dist.all_reduce(torch.ones(1), group=group)
                    error = "no error"
                except RuntimeError as err:
                    error = str(err)
                out.append((name, time.monotonic() - start, error))
            done.touch()
        else:  # outside any collective (a file, not a group), so it cannot time out itself
            deadline = time.monotonic() + 50
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        # both ranks leave together; the groups rank 0 timed out on are not used again
        dist.barrier(group=dist.new_group(backend="gloo"))
        destroy_layouts()
    return out


@pytest.mark.parametrize("separate_host", [True])  # device groups and their twins (CPU: one)
def test_every_layout_group_times_out_after_the_configured_time(separate_host, tmp_path):
    results = run_distributed(
        _lonely_collectives,
        2,
        args=(separate_host, tmp_path / "rank0_done"),
        timeout_s=60,
        env={"MEGATRON_EARL_PG_TIMEOUT": str(TIMEOUT_S)},
    )[0]
    names = ["tp", "tp host twin"] if separate_host else ["tp"]
    assert [name for name, _, _ in results] == names
    for name, seconds, error in results:
        assert "timed out" in error.lower() or "timeout" in error.lower(), (name, error)
        # wall clock, not arithmetic: the configured deadline, 0.5 s early for where gloo's timer
        # starts against ours, 5 s late for a loaded machine (Megatron's default is 30 minutes)
        assert TIMEOUT_S - 0.5 < seconds < TIMEOUT_S + 5, (name, seconds)
