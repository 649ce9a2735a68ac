"""``run``: ``asyncio.run`` of a coroutine whose result is never formatted.

In the main thread, ``asyncio.run`` (CPython 3.11) installs ``functools.partial(_on_sigint,
main_task=task)`` as the SIGINT handler and restores the default one on exit. ``signal.signal``
returns the replaced handler through ``signal._int_to_enum``, which tries ``Handlers(handler)``;
that lookup's failure message formats ``repr`` of the partial, hence of the finished task, hence
``reprlib.repr`` of its result -- and reprlib truncates a dataclass's repr only after building it
whole. For a rollout that returns every trajectory's token ids, that repr grew with the tokens
of the batch: 64 results of 20,000 ids took ~14 ms per call against ~0.3 ms with the result
wrapped (a one-off probe on this machine). ``run`` returns the result inside a wrapper with a
fixed repr and unwraps it; errors propagate unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Result:
    """A coroutine's result with a repr that does not format it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"<result: {type(self.value).__name__}>"


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` (a fresh event loop, closed after), its result never formatted."""

    async def wrapped() -> _Result:
        return _Result(await coro)

    return asyncio.run(wrapped()).value
