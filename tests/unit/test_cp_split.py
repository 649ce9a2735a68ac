"""Pure CP chunking helpers (``megatron_earl.parallel.cp``) and the global-order rebuild of
all-gathered K/V in ``ContextParallelSDPAttention``: exact index arithmetic, no processes."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.parallel.cp import (
    CPLengthError,
    check_cp_length,
    cp_chunk_bounds,
    cp_padded_length,
    cp_token_index,
    merge_cp_shards,
    packed_cp_token_index,
    split_batch_for_cp,
)


@pytest.mark.parametrize(
    ("seq_len", "cp", "cp_rank", "expected"),
    [
        (8, 1, 0, ((0, 8), (8, 8))),
        (8, 2, 0, ((0, 2), (6, 8))),
        (8, 2, 1, ((2, 4), (4, 6))),
        (12, 3, 0, ((0, 2), (10, 12))),
        (12, 3, 1, ((2, 4), (8, 10))),
        (12, 3, 2, ((4, 6), (6, 8))),
        (16, 4, 3, ((6, 8), (8, 10))),
    ],
)
def test_chunk_bounds_table(seq_len, cp, cp_rank, expected):
    assert cp_chunk_bounds(seq_len, cp, cp_rank) == expected


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_token_indices_partition_the_sequence_and_balance_causal_work(cp):
    seq_len = 2 * cp * 5
    indices = [cp_token_index(seq_len, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(indices)).values, torch.arange(seq_len))
    # causal work of a token at position p is p + 1 keys: equal on every rank
    work = {int((idx + 1).sum()) for idx in indices}
    assert len(work) == 1


@pytest.mark.parametrize(
    ("length", "cp", "padded"), [(0, 2, 0), (1, 2, 4), (16, 2, 16), (17, 4, 24), (5, 1, 5)]
)
def test_cp_padded_length(length, cp, padded):
    assert cp_padded_length(length, cp) == padded


def test_impossible_length_names_the_values_and_the_padded_length():
    with pytest.raises(CPLengthError) as err:
        check_cp_length(30, 2)
    msg = str(err.value)
    assert "30" in msg and "2 x cp = 4" in msg and "cp = 2" in msg and "32" in msg
    batch = {"tokens": torch.zeros(1, 30, dtype=torch.long)}
    with pytest.raises(CPLengthError, match="30 is not divisible by 2 x cp = 4"):
        split_batch_for_cp(batch, 2, 0)
    with pytest.raises(CPLengthError, match="packed sequence 1"):
        packed_cp_token_index([0, 8, 14], 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        cp_chunk_bounds(8, 2, 2)


@pytest.mark.parametrize("cp", [2, 4])
def test_split_then_merge_round_trips_a_batch(cp):
    seq_len = 2 * cp * 3
    batch = {
        "tokens": torch.arange(2 * seq_len).view(2, seq_len),
        "loss_mask": torch.rand(2, seq_len),
        "position_ids": torch.arange(seq_len).expand(2, -1),
        "attention_mask": torch.rand(2, 1, seq_len, seq_len) > 0.5,
        "scalar": torch.tensor(3.0),
        "packed_seq_params": None,
    }
    shards = [split_batch_for_cp(batch, cp, r) for r in range(cp)]
    for r, shard in enumerate(shards):
        idx = cp_token_index(seq_len, cp, r)
        assert torch.equal(shard["position_ids"][0], idx)
        assert shard["attention_mask"].shape == (2, 1, seq_len // cp, seq_len)
        assert torch.equal(shard["attention_mask"], batch["attention_mask"][:, :, idx])
        assert shard["scalar"] is batch["scalar"] and shard["packed_seq_params"] is None
    for key in ("tokens", "loss_mask", "position_ids"):
        assert torch.equal(merge_cp_shards([s[key] for s in shards]), batch[key])


def test_packed_split_is_per_sequence():
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    tokens = torch.arange(24).unsqueeze(0)
    shards = [split_batch_for_cp({"tokens": tokens}, 2, r, cu_seqlens_padded=cu) for r in (0, 1)]
    # rank 0: seq0 chunks 0 and 3 of 2 tokens, seq1 chunks of 1 token, seq2 chunks of 3 tokens
    assert shards[0]["tokens"][0].tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]
    assert shards[1]["tokens"][0].tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]
    merged = merge_cp_shards([s["tokens"] for s in shards], cu_seqlens_padded=cu)
    assert torch.equal(merged, tokens)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_gathered_kv_rebuilds_global_order(cp):
    from megatron_earl.models.cp_attention import _to_global_order

    seq_len = 2 * cp * 4
    full = torch.randn(seq_len, 2, 3, 5)  # [s, b, heads, dim]
    gathered = torch.stack([full[cp_token_index(seq_len, cp, r)] for r in range(cp)])
    assert torch.equal(_to_global_order(gathered), full)
