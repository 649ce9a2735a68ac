"""Weight resharding between layouts, in the same processes, bitwise.

For a tiny GQA model with QKV bias, untied and tied embeddings: every layout is built once and
loaded directly with the reference weights (``load_full_state_dict`` of a deterministic random
full state dict); then for every pair (A, B) B's parameters are poisoned with NaN, A -> B is
resharded and B must equal its directly loaded weights bitwise; A is poisoned, B -> A is
resharded and A must equal its original weights bitwise. Pairs: all among dp2, tp2, pp2, cp2 and
pp2 x vpp2 on 2 processes; all among tp2pp2, tp2cp2, cp2dp2 on 4 processes. The bucket bound is
small (4 KiB) so tensors are split and many rounds run; each rank's buffers must stay within it,
and each rank must receive exactly what its destination shards lack (never the full model).
Tolerance: none (bitwise).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed

BUCKET_BYTES = 4096
MODEL = ModelConfig(
    num_layers=4,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=60,
    make_vocab_size_divisible_by=16,
    add_qkv_bias=True,
)
MODELS = [MODEL, ModelConfig(**{**MODEL.to_dict(), "tie_embeddings": True})]
LAYOUTS_2 = [
    ParallelLayout(dp=2),
    ParallelLayout(tp=2),
    ParallelLayout(pp=2),
    ParallelLayout(cp=2),
    ParallelLayout(pp=2, vpp=2),
]
LAYOUTS_4 = [ParallelLayout(tp=2, pp=2), ParallelLayout(tp=2, cp=2), ParallelLayout(cp=2, dp=2)]


def _reference(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The reference global tensor of a key: random, the same on every rank."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


@torch.no_grad()
def _poison(pieces) -> None:
    for p in pieces:
        p.local.fill_(float("nan"))


def _check(pieces, expected, what: str) -> None:
    for p, want in zip(pieces, expected, strict=True):
        if not torch.equal(_bits(p.local), _bits(want)):
            raise AssertionError(f"{what}: {p.param_name} ({p.key} {p.region}) differs")


def _round_trips(models: list[ModelConfig], layouts: list[ParallelLayout], bucket: int):
    """Every rank: build each layout once, then A -> B -> A for every pair; per-pair stats."""
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import load_full_state_dict, shard_pieces
    from megatron_earl.redistribute.weight_exec import reshard_weights

    out = []
    for model in models:
        built = {}
        for layout in layouts:
            use_layout(layout)
            runtime.seed(7)
            chunks = build_model(model, vpp=layout.vpp)
            pieces = shard_pieces(chunks)
            load_full_state_dict(chunks, {p.key: _reference(p.key, p.global_shape) for p in pieces})
            built[layout] = (chunks, pieces, [p.local.clone() for p in pieces])
        for a, b in itertools.combinations(layouts, 2):
            _, pieces_a, want_a = built[a]
            _, pieces_b, want_b = built[b]
            _poison(pieces_b)
            there = reshard_weights(pieces_a, pieces_b, bucket_bytes=bucket)
            _check(pieces_b, want_b, f"{a} -> {b} (tied={model.tie_embeddings})")
            _poison(pieces_a)
            back = reshard_weights(pieces_b, pieces_a, bucket_bytes=bucket)
            _check(pieces_a, want_a, f"{a} -> {b} -> {a} (tied={model.tie_embeddings})")
            needs = {
                "there": sum(p.local.nbytes for p in pieces_b),
                "back": sum(p.local.nbytes for p in pieces_a),
            }
            out.append((str(a), str(b), model.tie_embeddings, there, back, needs))
    return out


def _mismatched_models_fail(bucket: int) -> str:
    """Resharding a tied model into an untied one fails with the same error on every rank."""
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import shard_pieces
    from megatron_earl.redistribute.weight_exec import reshard_weights
    from megatron_earl.redistribute.weight_plan import WeightPlanError

    use_layout(ParallelLayout(dp=2))
    runtime.seed(7)
    tied = shard_pieces(build_model(MODELS[1]))
    use_layout(ParallelLayout(tp=2))
    untied = shard_pieces(build_model(MODELS[0]))
    try:
        reshard_weights(tied, untied, bucket_bytes=bucket)
    except WeightPlanError as err:
        return str(err)
    raise AssertionError("expected WeightPlanError")


def _verify(results_per_rank, bucket: int) -> int:
    pairs = 0
    for rank_results in results_per_rank:
        for a, b, tied, there, back, needs in rank_results:
            for stats, need in ((there, needs["there"]), (back, needs["back"])):
                assert stats.peak_buffer_bytes <= bucket, (a, b, tied, stats)
                # Exactly what the destination shards hold arrives (locally or by message).
                assert stats.bytes_received + stats.bytes_local == need, (a, b, tied, stats)
            pairs += 1
    # Whatever one rank sent, another received.
    for i in range(len(results_per_rank[0])):
        for leg in (3, 4):
            sent = sum(r[i][leg].bytes_sent for r in results_per_rank)
            assert sent == sum(r[i][leg].bytes_received for r in results_per_rank)
    return pairs


def test_round_trips_on_2_processes():
    results = run_distributed(
        _round_trips, 2, args=(MODELS, LAYOUTS_2, BUCKET_BYTES), timeout_s=240
    )
    assert _verify(results, BUCKET_BYTES) == 2 * len(MODELS) * 10


def test_round_trips_on_4_processes():
    results = run_distributed(
        _round_trips, 4, args=(MODELS, LAYOUTS_4, BUCKET_BYTES), timeout_s=300
    )
    assert _verify(results, BUCKET_BYTES) == 4 * len(MODELS) * 3


def test_mismatched_models_raise_on_every_rank():
    messages = run_distributed(_mismatched_models_fail, 2, args=(BUCKET_BYTES,), timeout_s=120)
    assert messages[0] == messages[1]
    assert "output_layer.weight" in messages[0] and "no source rank" in messages[0]


@pytest.mark.parametrize("bucket", [1 << 20])
def test_large_bucket_moves_in_one_round(bucket):
    results = run_distributed(
        _round_trips, 2, args=(MODELS[:1], LAYOUTS_2[:3], bucket), timeout_s=120
    )
    _verify(results, bucket)
    for _, _, _, there, back, _ in results[0]:
        assert there.num_rounds <= 1 and back.num_rounds <= 1


def _round_trips_host_groups(bucket: int):
    """``_round_trips`` with separate host groups forced (as on GPUs): bitwise all the same; the
    world is warmed up once for batched p2p; every group is destroyed at the end."""
    from megatron_earl.parallel.groups import forced_host_groups
    from megatron_earl.parallel.state import destroy_layouts

    with forced_host_groups() as cache:
        out = _round_trips(MODELS[:1], LAYOUTS_2[:3], bucket)
        warmups = cache.stats.p2p_warmups
        destroy_layouts()
    return out, warmups


def test_round_trips_with_host_groups():
    results = run_distributed(_round_trips_host_groups, 2, args=(BUCKET_BYTES,), timeout_s=180)
    assert _verify([r for r, _ in results], BUCKET_BYTES) == 2 * 3
    assert [w for _, w in results] == [1, 1]
