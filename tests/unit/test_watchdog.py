"""The watchdog's heartbeat board and ring check, in one process: two ``Watchdog`` objects, each
with its own client of one real TCP store (as every rank has its own client of the job's
rendezvous store; no file, so node-local run directories do not matter). The end-to-end
behaviour with a stopped process is tests/integration/test_run_signals.py."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from megatron_earl.config.vocab import Activity
from megatron_earl.orchestration.watchdog import Heartbeat, StoreBoard, Watchdog

TIMEOUT_S = 0.3


@pytest.fixture
def server():
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5),
        wait_for_workers=False,
    )  # fmt: skip
    yield store
    del store


def _board(server, launch: str = "L") -> StoreBoard:
    client = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=1),
        wait_for_workers=False,
    )  # fmt: skip
    return StoreBoard(client, launch=launch)


def _watchdog(board, rank, world=2, heartbeat=None, on_stuck=None) -> Watchdog:
    return Watchdog(
        board,
        rank,
        world,
        timeout_s=TIMEOUT_S,
        heartbeat=heartbeat or Heartbeat(),
        on_stuck=on_stuck or (lambda m, p: None),
    )


def _pair(server, launch_b: str = "L"):
    hb = Heartbeat()
    a = _watchdog(_board(server), 0)
    b = _watchdog(_board(server, launch_b), 1, heartbeat=hb)
    return a, b, hb


def test_a_silent_peer_is_named_with_its_activity_and_step(server):
    a, b, hb = _pair(server)
    a.start()
    hb.step = 3
    with hb.activity(Activity.TRAIN):
        b._beat()  # rank 1 beats once, then stops (as a stopped process would)
    assert a.watched == 1 and b.watched == 0
    assert a.check() is None
    time.sleep(TIMEOUT_S * 1.5)
    message = a.check()
    assert message is not None
    assert "watchdog: rank 1 (pid " in message
    assert "stopped or frozen in 'train' of step 3" in message
    assert "runtime.watchdog_timeout_s=0.3" in message
    assert a.peer.rank == 1 and a.peer.activity == "train" and a.peer.step == 3
    a.stop()


def test_a_beating_peer_is_not_reported(server):
    a, b, _ = _pair(server)
    for _ in range(6):
        b._beat()
        assert a.check() is None
        time.sleep(TIMEOUT_S / 3)


def test_a_peer_that_left_is_not_watched(server):
    a, b, _ = _pair(server)
    b.start()
    b.stop()  # "done"
    time.sleep(TIMEOUT_S * 1.5)
    assert a.check() is None


@pytest.mark.parametrize("launch_b", ["other launch"])
def test_a_record_of_another_launch_is_no_heartbeat(server, launch_b):
    a, b, _ = _pair(server, launch_b)
    b._beat()
    assert a.check() is None
    time.sleep(TIMEOUT_S * 1.5)
    message = a.check()
    assert message is not None and "rank 1 has given no heartbeat" in message


def test_the_thread_calls_on_stuck(server):
    stuck = []
    a = _watchdog(_board(server), 0, on_stuck=lambda m, p: stuck.append((m, p)))
    a.start()
    deadline = time.monotonic() + 10
    while not stuck and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stuck and stuck[0][1].rank == 1
    a.stop()


def test_world_of_one_watches_nobody(server):
    a = _watchdog(_board(server), 0, world=1)
    assert a.watched is None and a.check() is None


def test_a_board_that_stops_answering_names_the_store_and_no_rank():
    """The store's host gone (its server closed): within ``timeout_s`` the silence is tolerated,
    after it the message names the store and no peer process (nothing is killed)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5),
        wait_for_workers=False,
    )  # fmt: skip
    a, b, _ = _pair(store)
    b._beat()
    assert a.check() is None
    del store  # the server stops: every client's next call fails
    assert a.check() is None  # not yet timeout_s without an answer
    time.sleep(TIMEOUT_S * 1.5)
    message = a.check()
    assert message is not None and "the heartbeat board (127.0.0.1:" in message
    assert "has not answered" in message and "stopping the job" in message
    assert a.peer.pid is None
