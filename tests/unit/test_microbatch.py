"""Token-budget micro-batching: budgets respected, balanced, clear errors, packed thd layout, CP
split/merge round trip, next-token alignment."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_earl.training.microbatch import (
    MicroBatchError,
    build_micro_batches,
    merge_cp,
    next_token_sample,
    pack_micro_batch,
    plan_micro_batches,
    real_tokens,
    split_micro_batch,
    thd_micro_batch,
    unpack_per_sample,
)


def _sample(n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (n,), generator=gen)
    generated = torch.rand(n, generator=gen) < 0.5
    return next_token_sample(tokens, generated, rollout_logprobs=-torch.rand(n, generator=gen))


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_plan_respects_budget_covers_all_and_balances(cp, seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    budget = 320
    plan = plan_micro_batches(lengths, budget, cp)
    cost = [(-(-n // (2 * cp)) * 2 * cp if cp > 1 else n) // cp for n in lengths]
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    loads = [sum(cost[i] for i in mb) for mb in plan]
    assert max(loads) <= budget
    assert all(mb == sorted(mb) and mb for mb in plan)
    # never more micro-batches than first-fit-decreasing needs, and no trivially wasted bin
    assert len(plan) <= max(1, 2 * -(-sum(cost) // budget))
    if len(plan) > 1:  # balanced: the spread is at most the largest sample
        assert max(loads) - min(loads) <= max(cost)


def test_plan_spreads_tokens_evenly():
    lengths = [100] * 6 + [50] * 4
    plan = plan_micro_batches(lengths, max_tokens=400, cp=1)
    loads = sorted(sum(lengths[i] for i in mb) for mb in plan)
    assert loads == [400, 400]


def test_sample_above_budget_names_it():
    with pytest.raises(MicroBatchError, match=r"sample 2 has 900 tokens .* raise max_tokens"):
        plan_micro_batches([10, 20, 900, 30], max_tokens=512)
    with pytest.raises(MicroBatchError, match="max_tokens=0"):
        plan_micro_batches([1], max_tokens=0)
    assert plan_micro_batches([], max_tokens=8) == []
    # at cp=2 a 900-token sample holds 450 tokens per rank: it fits
    assert plan_micro_batches([900], max_tokens=512, cp=2) == [[0]]


def test_next_token_alignment():
    tokens = torch.tensor([5, 6, 7, 8])
    generated = torch.tensor([False, False, True, True])
    engine_lp = torch.tensor([0.0, 0.0, -0.5, -0.25])
    s = next_token_sample(tokens, generated, rollout_logprobs=engine_lp)
    assert s["labels"].tolist() == [6, 7, 8, 0]
    assert s["loss_mask"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert s["rollout_logprobs"].tolist() == [0.0, -0.5, -0.25, 0.0]
    with pytest.raises(MicroBatchError, match="generated shape"):
        next_token_sample(tokens, generated[:3])


def test_pack_layout_thd():
    samples = [_sample(n, i) for i, n in enumerate([5, 3, 7])]
    mb = pack_micro_batch(samples, [0, 2], cp=1)
    params = mb["packed_seq_params"]
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 5, 12]
    assert params.cu_seqlens_q_padded.tolist() == [0, 5, 12]
    assert mb["tokens"].shape == (1, 12)
    assert mb["seq_ids"].tolist() == [[0] * 5 + [1] * 7]
    assert mb["position_ids"].tolist() == [[*range(5), *range(7)]]
    assert torch.equal(mb["tokens"][0, 5:], samples[2]["tokens"])
    assert mb["sample_index"].tolist() == [0, 2]
    pieces = unpack_per_sample(mb["rollout_logprobs"], mb)
    assert torch.equal(pieces[1], samples[2]["rollout_logprobs"])


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_padding_split_and_merge_round_trip(cp):
    samples = [_sample(n, i) for i, n in enumerate([5, 3, 9, 1])]
    mb = pack_micro_batch(samples, [0, 1, 2, 3], cp=cp)
    params = mb["packed_seq_params"]
    padded = [-(-n // (2 * cp)) * 2 * cp for n in (5, 3, 9, 1)]
    assert (params.cu_seqlens_q_padded[1:] - params.cu_seqlens_q_padded[:-1]).tolist() == padded
    assert params.cu_seqlens_q.tolist() == [0, 5, 8, 17, 18]
    assert float(mb["loss_mask"].sum()) == sum(float(s["loss_mask"].sum()) for s in samples)
    shards = [split_micro_batch(mb, cp, r) for r in range(cp)]
    for shard in shards:
        assert shard["tokens"].size(1) == sum(padded) // cp
        # every CP rank holds a token of every sample (per-sample sums line up across ranks)
        assert set(shard["seq_ids"].unique().tolist()) == {0, 1, 2, 3}
        assert shard["packed_seq_params"] is params
    for name in ("tokens", "labels", "loss_mask", "rollout_logprobs", "seq_ids"):
        merged = merge_cp([s[name] for s in shards], mb)
        assert torch.equal(merged, mb[name]), name
    pieces = unpack_per_sample(merge_cp([s["labels"] for s in shards], mb), mb)
    for piece, sample in zip(pieces, samples, strict=True):
        assert torch.equal(piece, sample["labels"])


def test_build_checks_samples():
    good = [_sample(4, 0), _sample(6, 1)]
    assert len(build_micro_batches(good, max_tokens=10)) == 1
    assert len(build_micro_batches(good, max_tokens=6)) == 2
    bad = dict(good[1])
    del bad["labels"]
    with pytest.raises(MicroBatchError, match="sample 1 has fields"):
        build_micro_batches([good[0], bad], max_tokens=10)
    short = {**good[1], "loss_mask": torch.zeros(5)}
    with pytest.raises(MicroBatchError, match="not 1-D of length 6"):
        build_micro_batches([short], max_tokens=10)
    empty = {k: v[:0] for k, v in good[0].items()}
    with pytest.raises(MicroBatchError, match="sample 0 has 0 tokens"):
        build_micro_batches([empty], max_tokens=10)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_of_packed_fields_equals_packing_the_samples(cp):
    """A dispatched micro-batch (samples back to back) and the same samples as a list give the
    same model input; with cp = 1 the model input is a view of the received tensors."""
    samples = [_sample(n, i) for i, n in enumerate([5, 3, 9, 1])]
    packed = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    got = thd_micro_batch(packed, [5, 3, 9, 1], cp, sample_index=[10, 11, 12, 13])
    want = pack_micro_batch(samples, [0, 1, 2, 3], cp=cp)
    assert got.keys() == want.keys()
    for k in ("tokens", "labels", "loss_mask", "rollout_logprobs", "seq_ids", "position_ids"):
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    for k in ("cu_seqlens_q", "cu_seqlens_q_padded", "max_seqlen_q"):
        gp, wp = got["packed_seq_params"], want["packed_seq_params"]
        assert str(getattr(gp, k)) == str(getattr(wp, k)), k
    assert got["sample_index"].tolist() == [10, 11, 12, 13]
    if cp == 1:
        assert got["loss_mask"].data_ptr() == packed["loss_mask"].data_ptr()
    # results back as the dispatched per-token form: real tokens, packed order
    assert torch.equal(real_tokens(got["labels"], got), packed["labels"])
    with pytest.raises(MicroBatchError, match="at least one sample"):
        thd_micro_batch({}, [], cp)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("sp", [1, 2, 3, 4, 8])
def test_sequence_parallel_padding_makes_every_share_divide_by_tp(cp, sp):
    """Under sequence parallelism each CP rank's share of a micro-batch divides by tp: the last
    sample is padded further (a multiple of 2 x cp, at most 2 x cp x (tp - 1) tokens), its
    padding masked; the other samples and the unpacked results are unchanged."""
    from megatron_earl.parallel.cp import cp_padded_length, sequence_parallel_padding

    rng = random.Random(cp * 10 + sp)
    for _ in range(20):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
        samples = [_sample(n, i) for i, n in enumerate(lengths)]
        mb = pack_micro_batch(samples, list(range(len(lengths))), cp=cp, sp=sp)
        plain = pack_micro_batch(samples, list(range(len(lengths))), cp=cp)
        cp_padded = [cp_padded_length(n, cp) for n in lengths]
        extra = mb["tokens"].size(1) - sum(cp_padded)
        assert extra == sequence_parallel_padding(cp_padded, cp, sp)
        assert 0 <= extra <= (2 * cp if cp > 1 else 1) * (sp - 1)
        assert extra % (2 * cp if cp > 1 else 1) == 0
        shards = [split_micro_batch(mb, cp, r) for r in range(cp)]
        assert all(s["tokens"].size(1) % sp == 0 for s in shards)
        params = mb["packed_seq_params"]
        assert params.cu_seqlens_q.tolist() == plain["packed_seq_params"].cu_seqlens_q.tolist()
        assert params.max_seqlen_q == max(params.cu_seqlens_q_padded.diff().tolist())
        assert float(mb["loss_mask"].sum()) == float(plain["loss_mask"].sum())
        assert mb["seq_ids"][0, -1] == len(lengths) - 1  # the tail belongs to the last sample
        pieces = unpack_per_sample(merge_cp([s["labels"] for s in shards], mb), mb)
        for piece, sample in zip(pieces, samples, strict=True):
            assert torch.equal(piece, sample["labels"])
        assert torch.equal(real_tokens(mb["labels"], mb), real_tokens(plain["labels"], plain))


def test_sequence_parallel_padding_examples_and_bad_input():
    from megatron_earl.parallel.cp import sequence_parallel_padding

    assert sequence_parallel_padding([5, 6], cp=1, sp=4) == 1
    assert sequence_parallel_padding([4, 8], cp=2, sp=4) == 4  # shares 6 -> 8
    assert sequence_parallel_padding([4, 8], cp=2, sp=3) == 0  # shares of 6 divide by 3
    assert sequence_parallel_padding([7], cp=1, sp=1) == 0
    with pytest.raises(ValueError, match="sp >= 1"):
        sequence_parallel_padding([4], cp=1, sp=0)
    with pytest.raises(ValueError, match="not a multiple of cp = 2"):
        sequence_parallel_padding([5], cp=2, sp=2)
