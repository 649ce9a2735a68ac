"""The watchdog's heartbeat files and ring check, in one process (two ``Watchdog`` objects on one
directory; the end-to-end behaviour with a stopped process is
tests/integration/test_run_signals.py)."""

from __future__ import annotations

import time

import pytest

from megatron_earl.config.vocab import Activity
from megatron_earl.orchestration.watchdog import Heartbeat, Watchdog

TIMEOUT_S = 0.3


def _pair(tmp_path, launch_b: str = "L"):
    a = Watchdog(
        tmp_path,
        0,
        2,
        timeout_s=TIMEOUT_S,
        heartbeat=Heartbeat(),
        launch="L",
        on_stuck=lambda m, p: None,
    )
    hb = Heartbeat()
    b = Watchdog(
        tmp_path,
        1,
        2,
        timeout_s=TIMEOUT_S,
        heartbeat=hb,
        launch=launch_b,
        on_stuck=lambda m, p: None,
    )
    return a, b, hb


def test_a_silent_peer_is_named_with_its_activity_and_step(tmp_path):
    a, b, hb = _pair(tmp_path)
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


def test_a_beating_peer_is_not_reported(tmp_path):
    a, b, _ = _pair(tmp_path)
    for _ in range(6):
        b._beat()
        assert a.check() is None
        time.sleep(TIMEOUT_S / 3)


def test_a_peer_that_left_is_not_watched(tmp_path):
    a, b, _ = _pair(tmp_path)
    b.start()
    b.stop()  # "done"
    time.sleep(TIMEOUT_S * 1.5)
    assert a.check() is None


@pytest.mark.parametrize("launch_b", ["other launch"])
def test_a_file_of_another_launch_is_no_heartbeat(tmp_path, launch_b):
    a, b, _ = _pair(tmp_path, launch_b)
    b._beat()
    assert a.check() is None
    time.sleep(TIMEOUT_S * 1.5)
    message = a.check()
    assert message is not None and "rank 1 has given no heartbeat" in message


def test_the_thread_calls_on_stuck(tmp_path):
    stuck = []
    a = Watchdog(
        tmp_path,
        0,
        2,
        timeout_s=TIMEOUT_S,
        heartbeat=Heartbeat(),
        launch="L",
        on_stuck=lambda m, p: stuck.append((m, p)),
    )
    a.start()
    deadline = time.monotonic() + 10
    while not stuck and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stuck and stuck[0][1].rank == 1
    a.stop()


def test_world_of_one_watches_nobody(tmp_path):
    a = Watchdog(
        tmp_path,
        0,
        1,
        timeout_s=TIMEOUT_S,
        heartbeat=Heartbeat(),
        launch="L",
        on_stuck=lambda m, p: None,
    )
    assert a.watched is None and a.check() is None
