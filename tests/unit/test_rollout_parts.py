"""Pure parts of the rollout engines: KV-cache row planning and the row cache, sampling filters,
the vectorised draw and log-probs, HF <-> Megatron name/layout mapping, weight buckets and the
portable tensor payload."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.models.hf_mapping import (
    full_megatron_to_hf,
    global_shapes,
    hf_target,
    hf_tensor,
    hf_to_megatron,
    qkv_rows,
)
from megatron_earl.rollout.embedded.kv_cache import RowCache, RowTable, plan_free
from megatron_earl.rollout.embedded.sampling import filter_logits, logprob_mismatch, sample_tokens
from megatron_earl.rollout.weights.sync import (
    deserialize_named_tensors,
    iter_buckets,
    plan_buckets,
    serialize_named_tensors,
)


def _apply(rows: list, moves) -> None:
    for src, dst, _ in moves:
        rows[dst] = rows[src]


def test_row_table_parks_reuses_and_evicts_with_consistent_moves():
    """Random admissions, finishes (parking), reuses and evictions: after applying the emitted
    moves, every running item's row and every parked session's row hold its own data."""
    import random

    rng = random.Random(0)
    table = RowTable(6)
    physical: list = [None] * 6
    next_id = 0
    for _ in range(400):
        _apply(physical, table.take_moves())
        for row, item in enumerate(table.items):
            assert physical[row] == item
        for session, (row, cached) in table.parked.items():
            assert physical[row] == session and len(cached) > 0
        assert len(table.items) + len(table.parked) <= 6
        op = rng.random()
        if op < 0.45:  # admit, maybe reusing a parked session
            session = rng.choice([*table.parked, None, None])
            while not table.can_add(session) and table.evict({session}):
                pass
            if table.can_add(session):
                item = session or f"s{next_id}"
                next_id += 1
                row = table.add(item, 3, session)
                _apply(physical, table.take_moves())
                physical[row] = item
        elif op < 0.9 and table.items:  # finish rows in descending order, parking some
            rows = sorted(rng.sample(range(len(table.items)), rng.randint(1, len(table.items))))
            for row in reversed(rows):
                item = table.items[row]
                table.release(row, (item, (1, 2, 3)) if rng.random() < 0.7 else None)
        else:
            table.drop_parked()
    assert next_id > 50


def test_row_table_reuse_rules():
    table = RowTable(2)
    table.add("a", 3)
    table.release(0, ("a", (5, 6, 7)))
    assert table.reusable("a", (5, 6, 7, 8)) == 3  # the context extends the cached tokens
    assert table.reusable("a", (5, 6, 7)) == 0  # nothing left to prefill: not reused
    assert table.reusable("a", (5, 9, 7, 8)) == 0 and table.reusable("b", (5,)) == 0
    table.add("b", 2)  # row 0; the parked row of "a" is row 1
    assert not table.can_add() and table.can_add("a")  # "a" would take its own row 1 over
    assert table.evict(keep={"b"}) and not table.parked and table.can_add()
    table.add("c", 2)
    assert not table.evict()  # nothing parked to evict
    with pytest.raises(ValueError, match="all 2 rows are taken"):
        table.add("d", 1)


def test_plan_free_keeps_rows_contiguous():
    assert plan_free(4, 1) == (3, 1)  # the last row refills the hole
    assert plan_free(4, 3) is None  # the last row just goes
    with pytest.raises(ValueError, match="row 4 is not a running row"):
        plan_free(4, 4)


def test_row_cache_writes_moves_and_views():
    cache = RowCache(2, 1, 2, 3, 4, dtype=torch.float32, device=torch.device("cpu"))
    k = torch.arange(4.0).reshape(2, 1, 2)
    cache.write(1, torch.tensor([0, 2]), torch.tensor([1, 3]), k, -k)
    assert cache.keys[1][2, 0, 3].tolist() == [2.0, 3.0]
    assert cache.values[1][0, 0, 1].tolist() == [0.0, -1.0]
    cache.move_row(2, 0, 4)
    keys, values = cache.view(1, 0, 2, 4)
    assert keys.shape == (2, 1, 4, 2)
    assert keys[0, 0, 3].tolist() == [2.0, 3.0] and values[0, 0, 3].tolist() == [-2.0, -3.0]
    assert cache.nbytes() == 2 * 2 * 3 * 1 * 4 * 2 * 4


def test_sampling_filters_and_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0, 9.0]])  # id 3 is padding (vocab_size 3)
    greedy = SamplingParams(temperature=0.0)
    tokens, lps = sample_tokens(logits, 3, [greedy], [random.Random()])
    assert tokens == [1]  # the padded id never wins
    # raw logits, normalised over the real vocabulary (as the trainer, SGLang and HF do)
    assert lps[0] == pytest.approx(float(torch.log_softmax(logits[:, :3], -1)[0, 1]))
    rows = torch.tensor([[1.0, 3.0, 2.0], [0.0, 10.0, 0.0], [1.0, 2.0, 3.0]])
    one = torch.ones(3)
    kept = filter_logits(rows, one, torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.5, 1.0]))
    assert torch.isinf(kept[0, 0]) and not torch.isinf(kept[0, 1:]).any()  # top-k 2
    assert torch.isinf(kept[1, [0, 2]]).all() and kept[1, 1] == 10.0  # top-p 0.5
    assert torch.equal(kept[2], rows[2])  # row 3 unfiltered
    hot = filter_logits(rows[2:], torch.tensor([0.5]), torch.tensor([-1]), torch.tensor([1.0]))
    assert torch.equal(hot[0], rows[2] / 0.5)
    gens = [random.Random(0) for _ in range(2)]
    warm = SamplingParams(temperature=1.0)
    many = torch.tensor([[0.0, 0.0, 0.0, 50.0]] * 2)
    tokens, _ = sample_tokens(many, 3, [warm, warm], gens)
    assert all(t < 3 for t in tokens)


def test_sampling_matches_the_distribution_and_is_batch_invariant():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None].repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    stream = random.Random(3)
    tokens, _ = sample_tokens(logits, 4, params, [stream] * 4000)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)  # ~4 sigma at n = 4000
    # A seeded request draws the same token alone or beside others, greedy or sampled ones.
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    row = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    alone, _ = sample_tokens(row, 8, [seeded], [random.Random(11)])
    batch = torch.cat([torch.randn(2, 8), row])
    mixed, _ = sample_tokens(
        batch,
        8,
        [SamplingParams(temperature=0.0), SamplingParams(top_k=3), seeded],
        [stream, stream, random.Random(11)],
    )
    assert mixed[2] == alone[0]
    with pytest.raises(ValueError, match="need as many params and generators"):
        sample_tokens(batch, 8, [seeded], [stream])


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0),
        dict(temperature=0.6, top_k=5, top_p=0.8, min_p=0.05),
        dict(temperature=1e308, top_k=10**30),  # beyond float32: uniform over the vocabulary
    ],
    ids=["plain", "filtered", "extreme"],
)
def test_sampling_same_settings_equals_row_by_row(settings):
    """Rows sharing their filter settings (one object, equal ones, ones differing only in seed
    and budget) are filtered with settings built at once; each row draws what it draws with
    its settings built row by row (beside a row of other settings), with the same log-prob."""
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    shared = SamplingParams(**settings)
    other = SamplingParams(temperature=0.3)
    alone = [  # row i then a row of other settings: the row-by-row path
        [x[:1] for x in sample_tokens(
            torch.cat([logits[i : i + 1], logits[:1]]), 9, [shared, other],
            [random.Random(i), random.Random(99)],
        )]
        for i in range(6)
    ]  # fmt: skip
    budgets = [SamplingParams(**settings, max_new_tokens=4 + i, seed=i) for i in range(6)]
    for params in ([shared] * 6, [SamplingParams(**settings) for _ in range(6)], budgets):
        tokens, lps = sample_tokens(logits, 9, params, [random.Random(i) for i in range(6)])
        assert tokens == [a[0][0] for a in alone]
        assert lps == pytest.approx([a[1][0] for a in alone], abs=1e-6)
    # One differing row takes the row-by-row settings: the others still draw the same.
    odd = [shared] * 5 + [other]
    tokens, _ = sample_tokens(logits, 9, odd, [random.Random(i) for i in range(6)])
    assert tokens[:5] == [a[0][0] for a in alone[:5]]


def test_logprob_mismatch():
    m = logprob_mismatch(
        torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.5]), torch.tensor([1, 0])
    )
    assert m["mismatch_max_abs"] == 0.0 and m["mismatch_ratio_mean"] == 1.0


MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=100,
    make_vocab_size_divisible_by=64,
    add_qkv_bias=True,
    qk_layernorm=True,
)


def test_qkv_rows_follow_megatron_grouping():
    rows = qkv_rows(MODEL)  # 2 groups of [q q k v], head dim 8
    assert rows["q"].tolist() == list(range(0, 16)) + list(range(32, 48))
    assert rows["k"].tolist() == list(range(16, 24)) + list(range(48, 56))
    assert rows["v"].tolist() == list(range(24, 32)) + list(range(56, 64))


def test_hf_round_trip_is_exact():
    gen = torch.Generator().manual_seed(0)
    full = {k: torch.randn(s, generator=gen) for k, s in global_shapes(MODEL).items()}
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full[key][MODEL.vocab_size :] = 0  # padding rows do not exist in HF
    hf = full_megatron_to_hf(full, MODEL)
    assert hf["model.embed_tokens.weight"].shape == (100, 32)
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)
    assert hf["model.layers.0.mlp.up_proj.weight"].shape == (48, 32)
    assert "model.layers.0.self_attn.q_norm.weight" in hf
    back = hf_to_megatron(hf, MODEL)
    assert set(back) == set(full)
    for key, tensor in full.items():
        assert torch.equal(back[key], tensor), key
    for name, tensor in hf.items():  # get_weights_by_name's read of one HF tensor
        assert torch.equal(hf_tensor(full, name, MODEL), tensor), name
    tied = dataclasses.replace(MODEL, tie_embeddings=True)
    assert torch.equal(hf_tensor(full, "lm_head.weight", tied), hf["model.embed_tokens.weight"])


def test_hf_target_rejects_unknown_names():
    with pytest.raises(KeyError, match="not an HF"):
        hf_target("model.layers.9.self_attn.q_proj.weight", MODEL)


def test_buckets_and_payload():
    sizes = [40, 40, 100, 10, 10]
    assert plan_buckets(sizes, 64) == [[0], [1], [2], [3, 4]]
    named = [(f"t{i}", torch.zeros(n // 4)) for i, n in enumerate(sizes)]
    assert [[n for n, _ in b] for b in iter_buckets(named, 64)] == [
        ["t0"],
        ["t1"],
        ["t2"],
        ["t3", "t4"],
    ]
    payload = serialize_named_tensors(named[:2])
    back = deserialize_named_tensors(payload)
    assert [n for n, _ in back] == ["t0", "t1"] and torch.equal(back[0][1], named[0][1])
    with pytest.raises(ValueError, match="base64"):
        deserialize_named_tensors("@@@")
