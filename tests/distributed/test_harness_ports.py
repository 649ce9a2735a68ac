"""``testing.distributed.run_distributed`` when its rendezvous port is taken before rank 0's store
binds it (another pytest-xdist worker's process can take a port between ``free_port`` and the
bind): the launch repeats on a new port and the body runs once; a port taken at every attempt is
one clear error. Under xdist, ``free_port`` keeps each worker to its own residue of the ports."""

from __future__ import annotations

import socket

import pytest

from megatron_earl.testing import distributed
from megatron_earl.testing.distributed import DistributedTestError, run_distributed


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_taken_port_is_replaced_and_the_body_runs_once(monkeypatch, taken_port):
    ports = iter([taken_port])
    real = distributed.free_port
    monkeypatch.setattr(distributed, "free_port", lambda: next(ports, None) or real())
    assert run_distributed(_rank_and_world, 2, timeout_s=60) == [(0, 2), (1, 2)]


def test_a_port_taken_at_every_attempt_is_one_clear_error(monkeypatch, taken_port):
    monkeypatch.setattr(distributed, "free_port", lambda: taken_port)
    with pytest.raises(DistributedTestError, match="the rendezvous port was taken 3 times"):
        run_distributed(_rank_and_world, 2, timeout_s=60)


def test_xdist_workers_get_ports_of_their_own_residue(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    for worker in (0, 1):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        assert {distributed.free_port() // 2 % 2 for _ in range(8)} == {worker}
