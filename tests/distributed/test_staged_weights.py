"""The SGLang push's staging (``orchestration.engines.sglang.staged_weights``), on 2 ranks at tp2
and at pp2: rank 0 receives the model as consecutive buckets of parts -- one layer of a decoder
key, or a whole other tensor -- each bucket within the bound (or one larger part alone),
resharded only when asked for (one plan per bucket so far, never the whole model ahead);
together the parts equal the reference global tensors bitwise (tolerance: none, a reshard
copies bytes), and their HF names are those of the whole tensors' conversion. A second push
replans nothing (every bucket's plan from its cache). The other rank gets empty buckets and
takes part in every reshard."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_reshard import MODEL, _reference

BUCKET_BYTES = 8 << 10
"""A few layer slices of tests.distributed.test_reshard's model per bucket."""


def _stage(layout_text: str, dtype_name: str):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.models.hf_mapping import full_megatron_to_hf, global_shapes
    from megatron_earl.orchestration.engines.sglang import staged_weights
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import load_full_state_dict, shard_pieces

    use_layout(ParallelLayout.parse(layout_text))
    runtime.seed(7)
    chunks = build_model(MODEL)
    shapes = global_shapes(MODEL)
    reference = {k: _reference(k, tuple(s)) for k, s in shapes.items()}
    load_full_state_dict(chunks, reference)
    pieces = shard_pieces(chunks)
    dtype = getattr(torch, dtype_name)
    caches: dict = {}
    buckets: list[list[tuple[str, int]]] = []
    plans_when_read: list[int] = []
    hf: dict[str, torch.Tensor] = {}
    for bucket in staged_weights(pieces, MODEL, dtype, BUCKET_BYTES, caches=caches):
        plans_when_read.append(sum(c.stats.plans for c in caches.values()))
        buckets.append([(part.key, part.first_layer) for part in bucket])
        for part in bucket:
            n = part.tensor.size(0)
            layers = slice(part.first_layer, part.first_layer + n)
            want = reference[part.key][layers] if part.key.startswith("decoder.layers.") else None
            want = reference[part.key] if want is None else want
            if part.tensor.dtype != dtype or not torch.equal(part.tensor, want.to(dtype)):
                raise AssertionError(f"{part.key} layer {part.first_layer} differs")
            hf.update(part.hf_named(MODEL))
        if sum(p.tensor.nbytes for p in bucket) > BUCKET_BYTES and len(bucket) > 1:
            raise AssertionError(f"bucket {buckets[-1]} is over {BUCKET_BYTES} bytes")
    expected = full_megatron_to_hf(reference, MODEL) if any(buckets) else {}  # rank 0's
    if sorted(hf) != sorted(expected) or any(not torch.equal(hf[k], expected[k]) for k in hf):
        raise AssertionError("the parts' HF tensors differ from the whole model's")
    first = sum(c.stats.plans for c in caches.values())
    for _ in staged_weights(pieces, MODEL, dtype, BUCKET_BYTES, caches=caches):
        pass
    second = sum(c.stats.plans for c in caches.values())
    layer_keys = [k for k in shapes if k.startswith("decoder.layers.")]
    order = [(k, layer) for layer in range(MODEL.num_layers) for k in layer_keys]
    order += [(k, 0) for k in shapes if not k.startswith("decoder.layers.")]
    return buckets, plans_when_read, first, second, order


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_rank0_gets_the_model_bucket_by_bucket_and_a_repeat_replans_nothing(layout):
    results = run_distributed(_stage, 2, args=(layout, "float32"), timeout_s=240)
    (buckets, plans_when_read, first, second, order), (peer_buckets, *_) = results
    assert [u for bucket in buckets for u in bucket] == order  # every part, in order, once
    assert len(buckets) > 3
    assert plans_when_read == list(range(1, len(buckets) + 1))  # one reshard per bucket read
    assert first == second == len(buckets)  # the second push: every plan from its cache
    assert peer_buckets == [[] for _ in buckets]  # the peer took part in every reshard
