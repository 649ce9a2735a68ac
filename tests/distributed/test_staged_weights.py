"""The SGLang push's staging (``orchestration.engines.sglang.staged_weights``), on 2 ranks at tp2
and at pp2: rank 0 receives the model as consecutive buckets of whole global tensors, each
within the bucket bound (or one larger tensor alone), resharded only when asked for (one plan
per bucket so far, never the whole model ahead); together they equal the reference global
tensors bitwise (tolerance: none, a reshard copies bytes). A second push replans nothing (every bucket's plan from the cache). The other
rank gets empty buckets and takes part in every reshard."""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed

BUCKET_BYTES = 8 << 10
MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=60,
    make_vocab_size_divisible_by=16,
    add_qkv_bias=True,
)


def _reference(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen)


def _stage(layout_text: str, dtype_name: str):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.models.hf_mapping import global_shapes
    from megatron_earl.orchestration.engines.sglang import staged_weights
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import load_full_state_dict, shard_pieces
    from megatron_earl.redistribute.plan_cache import PlanCache

    use_layout(ParallelLayout.parse(layout_text))
    runtime.seed(7)
    chunks = build_model(MODEL)
    shapes = global_shapes(MODEL)
    load_full_state_dict(chunks, {k: _reference(k, tuple(s)) for k, s in shapes.items()})
    pieces = shard_pieces(chunks)
    dtype = getattr(torch, dtype_name)
    cache = PlanCache(max_entries=256)
    keys: list[list[str]] = []
    plans_when_read: list[int] = []
    for bucket in staged_weights(pieces, MODEL, dtype, BUCKET_BYTES, cache=cache):
        plans_when_read.append(cache.stats.plans)
        keys.append(list(bucket))
        for key, tensor in bucket.items():
            want = _reference(key, tuple(shapes[key])).to(dtype)
            if tensor.dtype != dtype or not torch.equal(tensor, want):
                raise AssertionError(f"{key} differs from the reference")
        if sum(t.nbytes for t in bucket.values()) > BUCKET_BYTES and len(bucket) > 1:
            raise AssertionError(f"bucket {list(bucket)} is over {BUCKET_BYTES} bytes")
    first = cache.stats.plans
    for _ in staged_weights(pieces, MODEL, dtype, BUCKET_BYTES, cache=cache):
        pass
    return keys, plans_when_read, first, cache.stats.plans, list(shapes)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_rank0_gets_the_model_bucket_by_bucket_and_a_repeat_replans_nothing(layout):
    results = run_distributed(_stage, 2, args=(layout, "float32"), timeout_s=240)
    (keys, plans_when_read, first, second, order), (peer_keys, *_) = results
    assert [k for bucket in keys for k in bucket] == order  # whole model, in order, once
    assert len(keys) > 3
    assert plans_when_read == list(range(1, len(keys) + 1))  # one reshard per bucket read
    assert first == second == len(keys)  # the second push: every plan from the cache
    assert peer_keys == [[] for _ in keys]  # the peer took part in every reshard
