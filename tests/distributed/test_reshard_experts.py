"""Resharding mixture-of-experts weights and Adam state between layouts with different ep, etp
and tp, in the same processes, bitwise.

A tiny MoE (4 experts, top-2, 2 layers, hidden 64; and the same with a shared expert and the
router's aux-loss-free ``expert_bias`` buffer) is built once in every layout and loaded directly
with deterministic random global weights (``load_full_state_dict``). For every pair (A, B): B is
poisoned with NaN, A -> B resharded, B compared **bitwise** with its directly loaded weights and
its logits with A's (fp32 bound of ``tests/tolerances.py``: the layouts sum in other orders);
then A is poisoned, B -> A, A compared bitwise with its original weights and its logits with
B's. 4 KiB buckets (split tensors, many rounds); each rank receives exactly what its destination
shards lack. Layouts on 2 processes: dp2 (ep1), dp2ep2, tp2 with sequence parallelism (ep1,
experts split over etp = tp), tp2ep2etp1, tp2etp1 (whole experts replicated over the tp ranks),
pp2. On 4 processes: tp2dp2 (ep1), dp4ep4 (one expert per rank), tp2dp2ep2 (etp2; weights only,
``NO_FORWARD``), tp2dp2ep4etp1, pp2dp2ep2, tp2pp2ep2etp1. Adam state (moments and step) moves with
the weights, bitwise, for every pair on 2 processes. Tolerance: none for weights and state
(bitwise); logits: ``FORWARD_TERMS``.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_moe import MOE
from tests.tolerances import assert_fp32_close, gpt_terms

BUCKET_BYTES = 4096
FULL = dataclasses.replace(
    MOE,
    moe_shared_expert_intermediate_size=32,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="none",
)
"""With a shared expert (split like the dense MLP) and the router's ``expert_bias`` buffer."""
MODELS = {"moe": MOE, "shared+bias": FULL}
SEQ = 12
"""Tokens per sequence of the logits batch (2 sequences; divisible by tp for sequence parallel)."""
FORWARD_TERMS = gpt_terms(FULL, SEQ)
"""A logit's chain of fp32 sums (the larger model's): the bound is ~1e-4 x max |logit|."""
LAYOUTS_2 = [
    ParallelLayout(dp=2),
    ParallelLayout(dp=2, ep=2),
    ParallelLayout(tp=2),
    ParallelLayout(tp=2, ep=2, etp=1),
    ParallelLayout(tp=2, etp=1),
    ParallelLayout(pp=2),
]
LAYOUTS_4 = [
    ParallelLayout(tp=2, dp=2),
    ParallelLayout(dp=4, ep=4),
    ParallelLayout(tp=2, dp=2, ep=2),
    ParallelLayout(tp=2, dp=2, ep=4, etp=1),
    ParallelLayout(pp=2, dp=2, ep=2),
    ParallelLayout(tp=2, pp=2, ep=2, etp=1),
]
NO_FORWARD = {ParallelLayout(tp=2, dp=2, ep=2)}
"""Layouts whose MoE forward does not run on gloo: with ep > 1 and etp > 1 the all-to-all
dispatcher all-gathers unequal token counts over the expert-TP group (megatron-core's
``_gather_along_first_dim`` with ``output_split_sizes`` calls ``all_gather`` on tensors of different
sizes, which NCCL accepts and gloo rejects). Their weights are still checked bitwise; their
logits are not compared."""
EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def _reference(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The reference global tensor of a key: random (norm weights around 1, the rest around 0
    with std 0.1, so the logits stay in a sane range), the same on every rank."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    noise = 0.1 * torch.randn(shape, generator=gen)
    return 1 + noise if "norm" in key else noise


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


@torch.no_grad()
def _poison(tensors) -> None:
    for t in tensors:
        t.fill_(float("nan"))


def _check(got, expected, names, what: str) -> None:
    for t, want, name in zip(got, expected, names, strict=True):
        if not torch.equal(_bits(t), _bits(want)):
            raise AssertionError(f"{what}: {name} differs")


def _capture(logits: torch.Tensor, batch):
    return logits.float().sum() * 0.0, {"logits": logits.detach().clone()}


@torch.no_grad()
def _logits(layout: ParallelLayout, chunks) -> torch.Tensor | None:
    """Full-vocabulary logits [2, SEQ, V] of the fixed batch in ``layout`` (made current), on
    the last pipeline stage; None elsewhere and in ``NO_FORWARD`` layouts. Every rank calls (the
    schedule, a tp all-gather)."""
    from megatron.core import tensor_parallel

    from megatron_earl.parallel.state import use_layout
    from megatron_earl.training.schedule import forward_backward
    from megatron_earl.training.step import synthetic_lm_batches

    if layout in NO_FORWARD:
        return None
    use_layout(layout)
    batch = synthetic_lm_batches(MOE.vocab_size, 1, 2, SEQ, seed=5)[0]
    metrics = forward_backward(chunks, [batch], _capture, forward_only=True)
    if not metrics:
        return None
    return tensor_parallel.gather_from_tensor_model_parallel_region(metrics[0]["logits"])


def _build(model, layout: ParallelLayout, optim=None):
    """Chunks of ``model`` in ``layout`` (made current) loaded with the reference weights; with
    ``optim``: DDP-wrapped, with an optimizer. Returns (chunks, pieces, optimizer)."""
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import load_full_state_dict, shard_pieces
    from megatron_earl.training.setup import build_optimizer, wrap_ddp

    use_layout(layout)
    runtime.seed(7)
    chunks = build_model(model, vpp=layout.vpp)
    pieces = shard_pieces(chunks)
    load_full_state_dict(chunks, {p.key: _reference(p.key, p.global_shape) for p in pieces})
    if optim is None:
        for chunk in chunks:
            chunk.eval()
        return chunks, pieces, None
    chunks = wrap_ddp(chunks, optim)
    return chunks, shard_pieces(chunks), build_optimizer(chunks, optim)


def _weight_round_trips(models: dict, layouts: list[ParallelLayout], bucket: int):
    """Every rank: build each layout once, then A -> B -> A for every pair, with logits."""
    from megatron_earl.redistribute.weight_exec import reshard_weights

    out = {"pairs": [], "logits": {}, "experts": {}}
    for name, model in models.items():
        built = {}
        for layout in layouts:
            chunks, pieces, _ = _build(model, layout)
            built[layout] = (chunks, pieces, [p.local.clone() for p in pieces])
            out["logits"][name, str(layout)] = _logits(layout, chunks)
            out["experts"][name, str(layout)] = sorted(
                {p.region[1:] for p in pieces if p.key == EXPERT_FC1}
            )
        for a, b in itertools.combinations(layouts, 2):
            chunks_a, pieces_a, want_a = built[a]
            chunks_b, pieces_b, want_b = built[b]
            names_a = [f"{p.param_name} ({p.key} {p.region})" for p in pieces_a]
            names_b = [f"{p.param_name} ({p.key} {p.region})" for p in pieces_b]
            _poison(p.local for p in pieces_b)
            there = reshard_weights(pieces_a, pieces_b, bucket_bytes=bucket)
            _check([p.local for p in pieces_b], want_b, names_b, f"{name}: {a} -> {b}")
            logits_b = _logits(b, chunks_b)
            _poison(p.local for p in pieces_a)
            back = reshard_weights(pieces_b, pieces_a, bucket_bytes=bucket)
            _check([p.local for p in pieces_a], want_a, names_a, f"{name}: {a} -> {b} -> {a}")
            logits_a = _logits(a, chunks_a)
            needs = (sum(p.local.nbytes for p in pieces_b), sum(p.local.nbytes for p in pieces_a))
            out["pairs"].append((name, str(a), str(b), there, back, needs, logits_b, logits_a))
    return out


def _verify_weights(results, models: dict, layouts: list[ParallelLayout], bucket: int) -> int:
    """Buffers within the bucket, exact receive volumes, sent == received, and the logits of
    every resharded model equal to its source's. Returns the number of pairs checked."""
    num_pairs = len(results[0]["pairs"])
    assert num_pairs == len(models) * len(layouts) * (len(layouts) - 1) // 2
    for i in range(num_pairs):
        name, a, b, *_ = results[0]["pairs"][i]
        for leg, need in ((3, 0), (4, 1)):
            for res in results:
                stats, needs = res["pairs"][i][leg], res["pairs"][i][5]
                assert stats.peak_buffer_bytes <= bucket, (name, a, b, stats)
                assert stats.bytes_received + stats.bytes_local == needs[need], (a, b, stats)
            sent = sum(res["pairs"][i][leg].bytes_sent for res in results)
            assert sent == sum(res["pairs"][i][leg].bytes_received for res in results)
        for source, leg in ((a, 6), (b, 7)):
            if {ParallelLayout.parse(a), ParallelLayout.parse(b)} & NO_FORWARD:
                continue
            expected = [
                r["logits"][name, source] for r in results if r["logits"][name, source] is not None
            ]
            got = [r["pairs"][i][leg] for r in results if r["pairs"][i][leg] is not None]
            assert expected and got, (name, a, b)
            for logits in got:
                for want in expected:
                    assert_fp32_close(logits, want, FORWARD_TERMS, msg=f"{name}: {a} <-> {b}")
    return num_pairs


def _assert_expert_split(results, layout: ParallelLayout, num_experts: int) -> None:
    """Each rank holds num_experts / ep experts (layer and expert axes of fc1's pieces)."""
    for res in results:
        experts = {region[0] for region in res["experts"]["moe", str(layout)]}
        assert len(experts) == num_experts // layout.ep, (layout, experts)


def test_expert_weights_round_trip_between_every_pair_on_2_processes():
    results = run_distributed(
        _weight_round_trips, 2, args=(MODELS, LAYOUTS_2, BUCKET_BYTES), timeout_s=600
    )
    assert _verify_weights(results, MODELS, LAYOUTS_2, BUCKET_BYTES) == 2 * 15
    for layout in LAYOUTS_2:
        _assert_expert_split(results, layout, MOE.num_experts)


def test_expert_weights_round_trip_between_every_pair_on_4_processes():
    models = {"shared+bias": FULL}
    results = run_distributed(
        _weight_round_trips, 4, args=(models, LAYOUTS_4, BUCKET_BYTES), timeout_s=900
    )
    assert _verify_weights(results, models, LAYOUTS_4, BUCKET_BYTES) == 15


def _adam_state(optimizer) -> dict[int, dict]:
    """``id(parameter)`` -> its Adam state (fp32 parameters: the optimizer steps them)."""
    from megatron_earl.redistribute.optimizer_state import sub_optimizers, torch_optimizer

    return {
        id(p): state
        for sub in sub_optimizers(optimizer)
        for p, state in torch_optimizer(sub).state.items()
    }


def _state_views(pieces, optimizer) -> tuple[list[torch.Tensor], list[str]]:
    """Every piece's weight and its views into exp_avg / exp_avg_sq (keys for names)."""
    states = _adam_state(optimizer)
    views, names = [], []
    for p in pieces:
        views.append(p.local)
        names.append(f"{p.key} {p.region}")
        if id(p.param) in states:  # not the expert_bias buffer (no optimizer state)
            for kind in ("exp_avg", "exp_avg_sq"):
                views.append(p.view_of(states[id(p.param)][kind]))
                names.append(f"{p.key}.{kind} {p.region}")
    return views, names


def _optimizer_round_trips(model, layouts: list[ParallelLayout], bucket: int):
    """Every rank: in each layout a DDP model with reference weights and reference Adam state
    (moments from ``_reference`` of ``{key}.exp_avg`` etc., step 3); then for every pair A -> B
    -> A with ``reshard_model_and_optimizer``, each side poisoned (NaN, step 0) first."""
    from megatron_earl.config.optim import OptimConfig
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import region_slices
    from megatron_earl.redistribute.optimizer_state import (
        init_adam_state,
        reshard_model_and_optimizer,
    )

    optim = OptimConfig(lr=1e-3)
    built = {}
    for layout in layouts:
        _, pieces, optimizer = _build(model, layout, optim)
        init_adam_state(optimizer)
        states = _adam_state(optimizer)
        with torch.no_grad():
            for p in pieces:
                for kind in ("exp_avg", "exp_avg_sq") if id(p.param) in states else ():
                    full = _reference(f"{p.key}.{kind}", p.global_shape).abs()
                    view = p.view_of(states[id(p.param)][kind])
                    view.copy_(full[region_slices(p.region)].reshape(view.shape))
            for state in states.values():
                state["step"].fill_(3)
        views, names = _state_views(pieces, optimizer)
        built[layout] = (pieces, optimizer, [v.clone() for v in views], names)
    steps = []
    for a, b in itertools.combinations(layouts, 2):
        for src, dst in ((a, b), (b, a)):
            pieces_s, opt_s, _, _ = built[src]
            pieces_d, opt_d, want, names = built[dst]
            views, _ = _state_views(pieces_d, opt_d)
            _poison(views)
            for state in _adam_state(opt_d).values():
                state["step"].fill_(0)
            use_layout(dst)
            reshard_model_and_optimizer(pieces_s, opt_s, pieces_d, opt_d, bucket_bytes=bucket)
            _check(views, want, names, f"{src} -> {dst}")
            steps.append({float(s["step"]) for s in _adam_state(opt_d).values()})
    keys = {name.split(" ")[0] for layout in layouts for name in built[layout][3]}
    return {"steps": steps, "keys": keys}


def test_adam_state_moves_with_expert_weights_between_every_pair():
    results = run_distributed(
        _optimizer_round_trips, 2, args=(FULL, LAYOUTS_2, BUCKET_BYTES), timeout_s=600
    )
    for res in results:
        assert len(res["steps"]) == 2 * 15
        assert all(steps == {3.0} for steps in res["steps"])
        for kind in ("exp_avg", "exp_avg_sq"):
            assert f"{EXPERT_FC1}.{kind}" in res["keys"]
            assert f"decoder.layers.mlp.router.weight.{kind}" in res["keys"]
        assert "decoder.layers.mlp.router.expert_bias.exp_avg" not in res["keys"]


@pytest.mark.parametrize("layout", [ParallelLayout(dp=2, ep=2)], ids=str)
def test_expert_bias_is_a_piece(layout):
    """The router's persistent ``expert_bias`` is moved like a replicated weight; its
    non-persistent token counter is not."""
    results = run_distributed(_bias_keys, 2, args=(layout,), timeout_s=180)
    for keys in results:
        assert "decoder.layers.mlp.router.expert_bias" in keys
        assert not any("local_tokens_per_expert" in key for key in keys)


def _bias_keys(layout: ParallelLayout) -> list[str]:
    from megatron_earl.redistribute.geometry import shard_pieces

    chunks, _, _ = _build(FULL, layout)
    return sorted({p.key for p in shard_pieces(chunks)})
