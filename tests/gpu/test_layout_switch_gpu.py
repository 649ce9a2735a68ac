"""Layout switching on 8 GPUs: the weights resharded point to point over NCCL along a chain of
8-rank layouts in the same processes, tp8 -> tp2dp4 -> tp4cp2 -> tp2pp2dp2 -> tp8, equal the
full model a single rank holds, bitwise, in every layout of the chain (every rank's every piece,
replicas included, and together covering every element), for an untied and a tied-embedding
model, with the reshard of tests/distributed/test_reshard.py (which checks pairs of 2- and
4-rank layouts on gloo). Only the first layout is loaded directly (from the deterministic random
reference of test_reshard); every later one is poisoned with NaN and filled by resharding from
the one before, so the last (tp8 again) is the first after four reshards. Each reshard keeps its
buffers within the bucket and receives exactly what its destination shards lack.

Tolerance: none (bitwise: resharding copies bytes)."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.redistribute.geometry import region_slices
from megatron_earl.testing.distributed import run_distributed
from megatron_earl.testing.shards import assemble_regions
from tests.distributed import test_reshard as cpu
from tests.gpu import requires_gpus, to_host

pytestmark = pytest.mark.gpu
BUCKET_BYTES = 16 << 10
"""Small against the model (~0.9 MiB): every reshard runs many rounds and splits tensors."""
MODEL = ModelConfig(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=64,
    num_attention_heads=8,
    num_query_groups=8,  # tp8 needs 8 KV heads
    vocab_size=128,  # a multiple of 16 x 8: no padding whatever the tp
    make_vocab_size_divisible_by=16,
    add_qkv_bias=True,
)
MODELS = [MODEL, ModelConfig(**{**MODEL.to_dict(), "tie_embeddings": True})]
CHAIN = [
    ParallelLayout(tp=8),
    ParallelLayout(tp=2, dp=4),
    ParallelLayout(tp=4, cp=2),
    ParallelLayout(tp=2, pp=2, dp=2),
    ParallelLayout(tp=8),
]


def _snapshot(pieces):
    return [(p.key, p.global_shape, p.region, p.local.detach().clone()) for p in pieces]


def _chain(models: list[ModelConfig], chain: list[ParallelLayout], bucket: int):
    """Every rank: per model, build each layout of ``chain`` once (its first entry loaded with
    the reference weights, the others NaN), reshard along the chain; each step's pieces (after
    it was filled) and reshard stats, on the host."""
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import load_full_state_dict, shard_pieces
    from megatron_earl.redistribute.weight_exec import reshard_weights

    out = []
    for model in models:
        built = {}
        for layout in dict.fromkeys(chain):
            use_layout(layout)
            runtime.seed(7)
            chunks = build_model(model, vpp=layout.vpp)
            built[layout] = (chunks, shard_pieces(chunks))
        chunks, first = built[chain[0]]
        load_full_state_dict(chunks, {p.key: cpu._reference(p.key, p.global_shape) for p in first})
        steps = [(str(chain[0]), _snapshot(first), None, None)]
        for src, dst in itertools.pairwise(chain):
            pieces = built[dst][1]
            cpu._poison(pieces)
            stats = reshard_weights(built[src][1], pieces, bucket_bytes=bucket)
            steps.append((str(dst), _snapshot(pieces), stats, sum(p.local.nbytes for p in pieces)))
        out.append((model.tie_embeddings, steps))
    return to_host(out)


@requires_gpus(8)
def test_weights_resharded_along_8_rank_layouts_equal_the_full_model_bitwise():
    results = run_distributed(_chain, 8, args=(MODELS, CHAIN, BUCKET_BYTES), timeout_s=600)
    for m, model in enumerate(MODELS):
        for s, layout in enumerate(CHAIN):
            where = f"{layout} (step {s}, tied={model.tie_embeddings})"
            per_rank = [r[m][1][s] for r in results]
            assert {name for name, _, _, _ in per_rank} == {str(layout)}
            for rank, (_, pieces, stats, need) in enumerate(per_rank):
                for key, shape, region, local in pieces:
                    want = cpu._reference(key, shape)[region_slices(region)].reshape(local.shape)
                    assert torch.equal(cpu._bits(local), cpu._bits(want)), (where, rank, key)
                if stats is not None:
                    assert stats.peak_buffer_bytes <= BUCKET_BYTES, (where, rank, stats)
                    assert stats.bytes_received + stats.bytes_local == need, (where, rank, stats)
            # every element of every tensor is held by some rank (asserted by assemble_regions)
            full = assemble_regions(pieces for _, pieces, _, _ in per_rank)
            for key, tensor in full.items():
                assert torch.equal(cpu._bits(tensor), cpu._bits(cpu._reference(key, tensor.shape)))
            if s:  # whatever one rank sent, another received
                sent = sum(stats.bytes_sent for _, _, stats, _ in per_rank)
                assert sent == sum(stats.bytes_received for _, _, stats, _ in per_rank), where
