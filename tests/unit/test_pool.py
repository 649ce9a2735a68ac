"""Engine pool: least-loaded routing, session stickiness, failover on engine errors, no failover
on rejected requests. Engines here are small in-memory ``Engine`` implementations; the same pool
over real server processes (one killed) is tested in tests/integration/test_serve.py."""

from __future__ import annotations

import asyncio

import pytest

from megatron_earl.rollout.engine import (
    EngineError,
    FinishReason,
    FinishType,
    GenerateRequest,
    GenerateResult,
)
from megatron_earl.rollout.sglang.client import EngineRequestError
from megatron_earl.rollout.sglang.pool import EnginePool, PoolConfig, choose_engine


class _Engine:
    def __init__(self, name: str, fail: Exception | None = None, delay: float = 0.0):
        self.name, self.fail, self.delay = name, fail, delay
        self.served: list[str] = []
        self.weight_version = 3

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        self.served.append(request.session or "")
        return GenerateResult(request.rid, (1,), (-0.1,), FinishReason(FinishType.LENGTH), 3)

    async def abort(self, rid: str) -> None: ...

    async def health(self) -> bool:
        return self.fail is None


@pytest.mark.parametrize(
    "loads,healthy,sticky,expected",
    [
        ([0, 0, 0], [True] * 3, None, 0),
        ([2, 1, 3], [True] * 3, None, 1),
        ([2, 1, 3], [True, False, True], None, 0),
        ([0, 5, 0], [True] * 3, 1, 1),
        ([0, 5, 0], [True, False, True], 1, 0),
    ],
)
def test_choose_engine(loads, healthy, sticky, expected):
    assert choose_engine(loads, healthy, sticky) == expected


def test_choose_engine_without_healthy_engines():
    with pytest.raises(EngineError, match="no healthy engine"):
        choose_engine([0, 0], [False, False], None)


def test_least_loaded_and_sticky_sessions():
    async def body():
        a, b = _Engine("a", delay=0.05), _Engine("b", delay=0.05)
        pool = EnginePool([a, b])
        await asyncio.gather(
            *(pool.generate(GenerateRequest((1,), session=f"s{i}")) for i in range(4))
        )
        assert len(a.served) == 2 and len(b.served) == 2  # spread by load
        owner = a if "s0" in a.served else b
        await asyncio.gather(
            *(pool.generate(GenerateRequest((1,), session="s0")) for _ in range(3))
        )
        assert owner.served.count("s0") == 4  # the session stays on its engine
        assert pool.weight_version == 3

    asyncio.run(body())


def test_failover_moves_request_and_session():
    async def body():
        dead, alive = _Engine("dead", fail=EngineError("connection refused")), _Engine("alive")
        pool = EnginePool([dead, alive], PoolConfig(max_failovers=1))
        result = await pool.generate(GenerateRequest((1,), rid="r", session="s"))
        assert result.output_ids == (1,) and alive.served == ["s"]
        assert pool.healthy == [False, True] and pool.failovers == 1
        await pool.generate(GenerateRequest((1,), session="s"))
        assert alive.served == ["s", "s"]
        assert await pool.check_health() == [False, True]

    asyncio.run(body())


def test_rejected_request_is_not_retried_elsewhere():
    async def body():
        bad = _Engine("bad", fail=EngineRequestError(400, "token ids outside the vocabulary"))
        other = _Engine("other")
        pool = EnginePool([bad, other])
        with pytest.raises(EngineRequestError, match="outside the vocabulary"):
            await pool.generate(GenerateRequest((1,)))
        assert other.served == [] and pool.healthy == [True, True]

    asyncio.run(body())


def test_all_engines_failing_raises():
    async def body():
        pool = EnginePool(
            [_Engine("x", fail=EngineError("down")), _Engine("y", fail=EngineError("down"))]
        )
        with pytest.raises(EngineError, match="every engine tried"):
            await pool.generate(GenerateRequest((1,)))

    asyncio.run(body())
