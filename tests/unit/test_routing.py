"""Routing replay's pure pieces: the ``routing`` section, the route checks and fills, the routes'
way through a trajectory, its sample, the packed micro-batch and the context-parallel split, and
the start-up refusals. The engine's recorded routes and the trainer's replay run in
``tests/distributed/test_embedded_engine.py`` and ``tests/integration/test_trainer_moe.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_earl.config import load_config
from megatron_earl.config.routing import RoutingConfig, RoutingConfigError
from megatron_earl.config.run import ConfigError
from megatron_earl.config.vocab import Phase, RoutingReplay
from megatron_earl.models.routing import (
    RoutingError,
    check_routes,
    disagreement,
    filled,
    sequence_parallel_slice,
)
from megatron_earl.orchestration.samples import sample_routes
from megatron_earl.rollout.agent.loop import _routes_problem
from megatron_earl.rollout.agent.trajectory import Trajectory
from megatron_earl.rollout.engine import FinishReason, FinishType, GenerateResult
from megatron_earl.training.microbatch import ROUTES, split_micro_batch, thd_micro_batch

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_moe_cpu.yaml"


def test_the_section_parses_and_names_what_is_valid():
    config = RoutingConfig(replay="rollout", phases=("train",))
    assert config.replay is RoutingReplay.ROLLOUT and config.records
    assert config.replays(Phase.TRAIN) and not config.replays(Phase.EXPERIENCE)
    assert not RoutingConfig().records and RoutingConfig(measure=True).records
    with pytest.raises(RoutingConfigError, match=r"replay 'engine' is not one of \('none', "):
        RoutingConfig(replay="engine")
    with pytest.raises(RoutingConfigError, match=r"phases \['rollout'\] cannot replay routes"):
        RoutingConfig(replay="rollout", phases=("rollout",))
    with pytest.raises(RoutingConfigError, match="name a phase twice"):
        RoutingConfig(phases=("train", "train"))
    with pytest.raises(ConfigError, match="routing: replay 'always' is not one of"):
        load_config(None, ["routing.replay=always"])


def test_bad_routes_are_refused_naming_the_value_and_what_is_valid():
    good = torch.tensor([[[0, 3], [1, 2]]])  # one token, 2 layers, top-2 of 4 experts
    check_routes(good, 2, 2, 4)
    with pytest.raises(RoutingError, match=r"shape \(1, 2, 2\); this model needs \[tokens, 3"):
        check_routes(good, 3, 2, 4)
    with pytest.raises(RoutingError, match=r"experts in \[0, 3\]; this model has experts \[0, 3\)"):
        check_routes(good, 2, 2, 3)
    with pytest.raises(RoutingError, match="token 0 at layer 0 names expert 1 twice"):
        check_routes(torch.tensor([[[1, 1], [0, 2]]]), 2, 2, 4)
    with pytest.raises(RoutingError, match=r"integer expert ids, got torch\.float32"):
        check_routes(good.float(), 2, 2, 4)


def test_fill_compare_and_sequence_parallel_slice():
    routes = torch.tensor([[[2, 3]], [[-1, -1]], [[1, 0]]])
    assert filled(routes).tolist() == [[[2, 3]], [[0, 1]], [[1, 0]]]
    # sets, not orders: [1, 0] and [0, 1] agree
    assert disagreement(routes, torch.tensor([[[3, 2]], [[-1, -1]], [[0, 1]]])).tolist() == [
        [False],
        [False],
        [False],
    ]
    assert disagreement(routes, torch.tensor([[[2, 1]], [[-1, -1]], [[1, 0]]]))[0, 0]
    four = torch.arange(8).view(4, 1, 2)
    assert sequence_parallel_slice(four, 2, 1).tolist() == four[2:].tolist()
    with pytest.raises(RoutingError, match="3 tokens do not split over tp=2"):
        sequence_parallel_slice(four[:3], 2, 0)


def _result(outputs: int, routes: torch.Tensor | None) -> GenerateResult:
    return GenerateResult(
        "r", tuple(range(outputs)), (0.0,) * outputs, FinishReason(FinishType.STOP), 0,
        routed_experts=routes,
    )  # fmt: skip


def test_a_turns_routes_are_checked_against_the_positions_it_computed():
    shape = (2, 2, 4)
    ok = torch.tensor([[0, 1], [2, 3]]).expand(6, 2, 2)
    # context 5 tokens, 3 outputs, the first 2 positions held: rows [2, 7)
    assert _routes_problem(_result(3, ok[:5]), 5, 2, shape) is None
    assert "returned none" in _routes_problem(_result(3, None), 5, 2, shape)
    assert "expected [5 positions (2 to 7)" in _routes_problem(_result(3, ok), 5, 2, shape)
    bad = ok[:5].clone()
    bad[0, 0, 0] = 9
    assert "experts [0, 4)" in _routes_problem(_result(3, bad), 5, 2, shape)


def test_a_trajectorys_routes_become_its_sample_and_follow_packing_and_the_cp_split():
    traj = Trajectory("g-0", 0, 1, prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], loss_mask=[1] * 3)
    turn = torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]], [[0, 2]]], dtype=torch.int32)
    traj.add_routes(turn)  # positions 0..4 of 6 tokens: the last token was never fed
    routes = sample_routes(traj, 1, 2)
    assert routes.dtype == torch.int16 and routes.shape == (6, 1, 2)
    assert routes[:5].tolist() == turn.tolist() and routes[5].tolist() == [[-1, -1]]
    with pytest.raises(ValueError, match=r"the model needs \[positions, 2 layers, top-2\]"):
        sample_routes(traj, 2, 2)
    fields = {"tokens": torch.tensor(traj.token_ids), ROUTES: routes}
    packed = thd_micro_batch(fields, [6], cp=2)  # padded to 8 = 2 x cp x 2 chunks
    assert packed[ROUTES].shape == (1, 8, 1, 2) and packed[ROUTES].dtype == torch.int16
    assert packed[ROUTES][0, 6:].tolist() == [[[-1, -1]], [[-1, -1]]]
    for rank in range(2):  # every token keeps its own routes through the split
        local = split_micro_batch(packed, 2, rank)
        for token, route in zip(local["tokens"][0].tolist(), local[ROUTES][0].tolist()):
            if token:
                assert route == routes[traj.token_ids.index(token)].tolist()


def test_routing_is_refused_where_it_cannot_work():
    from megatron_earl.orchestration.validate import run_problems

    dense = load_config(None, ["routing.replay=rollout"])
    (problem,) = [p for p in run_problems(dense, 2) if "routing" in p]
    assert "needs a mixture-of-experts model" in problem
    moe = load_config(CONFIG, ["routing.replay=rollout", "model.recompute_granularity=full"])
    assert any("recomputed forward in the backward pass" in p for p in run_problems(moe, 2))
    sinkhorn = ["routing.measure=true", "model.moe_router_load_balancing_type=sinkhorn"]
    problems = run_problems(load_config(CONFIG, sinkhorn), 2)
    assert any("sinkhorn routing bypasses RouterReplay" in p for p in problems)
    assert not any(
        "routing" in p for p in run_problems(load_config(CONFIG, ["routing.replay=rollout"]), 2)
    )
    assert dataclasses.replace(moe.routing, replay="none").records is False
