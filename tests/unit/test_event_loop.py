"""``compat.event_loop.run``: ``asyncio.run`` whose result is never formatted (asyncio.run in
the main thread formats its main task's result when it restores the SIGINT handler)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from megatron_earl.compat import event_loop


class _Counted:
    """A result that counts how often it is formatted."""

    def __init__(self) -> None:
        self.reprs = 0

    def __repr__(self) -> str:
        self.reprs += 1
        return "counted"


def test_result_returned_and_never_formatted():
    value = _Counted()

    async def main() -> _Counted:
        await asyncio.sleep(0)
        return value

    assert event_loop.run(main()) is value
    assert value.reprs == 0
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # what run avoids
        plain = _Counted()

        async def again() -> _Counted:
            return plain

        assert asyncio.run(again()) is plain
        assert plain.reprs >= 1


def test_errors_propagate():
    async def fails() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError, match="k"):
        event_loop.run(fails())
