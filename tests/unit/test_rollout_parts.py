"""Pure parts of the rollout engines: KV-cache slot planning and masks, sampling filters and
log-probs, HF <-> Megatron name/layout mapping, weight buckets and the portable tensor payload."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.models.hf_mapping import (
    full_megatron_to_hf,
    global_shapes,
    hf_target,
    hf_to_megatron,
    qkv_rows,
)
from megatron_earl.rollout.kv_cache import decode_mask, plan_admit, plan_compaction, prefill_mask
from megatron_earl.rollout.sampling import filter_logits, logprob_mismatch, sample_tokens
from megatron_earl.rollout.weight_sync import (
    deserialize_named_tensors,
    iter_buckets,
    plan_buckets,
    serialize_named_tensors,
)


@pytest.mark.parametrize(
    "cursor,prompt,max_seq,shift", [(0, 5, 10, 5), (7, 5, 10, 0), (3, 10, 10, 7), (9, 9, 10, 0)]
)
def test_plan_admit(cursor, prompt, max_seq, shift):
    assert plan_admit(cursor, prompt, max_seq) == shift


def test_plan_admit_rejects_oversized_prompt():
    with pytest.raises(ValueError, match="prompt length 11"):
        plan_admit(0, 11, 10)


def test_plan_compaction():
    assert plan_compaction(7, [3, 7], 10) == 0
    assert plan_compaction(10, [3, 7], 10) == 3
    with pytest.raises(ValueError, match="cannot grow"):
        plan_compaction(10, [10], 10)


def test_masks_are_right_aligned_and_causal():
    m = prefill_mask(cursor=5, prompt_len=3)[0, 0]  # queries at positions 2, 3, 4
    assert (~m).int().tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    d = decode_mask(cursor=4, lengths=[4, 1])[:, 0, 0]  # new token at position 4
    assert (~d).int().tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]


def test_sampling_filters_and_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0, 9.0]])  # id 3 is padding (vocab_size 3)
    greedy = SamplingParams(temperature=0.0)
    tokens, lps = sample_tokens(logits, 3, [greedy], [torch.Generator()])
    assert tokens == [1]  # the padded id never wins
    assert lps[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))  # raw, padded vocab
    kept = filter_logits(torch.tensor([1.0, 3.0, 2.0]), SamplingParams(top_k=2))
    assert torch.isinf(kept[0]) and not torch.isinf(kept[1:]).any()
    nucleus = filter_logits(torch.tensor([0.0, 10.0, 0.0]), SamplingParams(top_p=0.5))
    assert torch.isinf(nucleus[[0, 2]]).all()
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    hot = SamplingParams(temperature=1.0)
    many = torch.tensor([[0.0, 0.0, 0.0, 50.0]] * 2)
    tokens, _ = sample_tokens(many, 3, [hot, hot], gens)
    assert all(t < 3 for t in tokens)


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
