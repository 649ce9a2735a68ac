"""Prefix-shared packing plans (``training.prefix_tree``, ``models.tree_attention``): which
samples share a prefix, where every token of the tree row comes from and goes back to, the
attention batches (masks checked against a brute-force tree mask), and bad input."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.models import tree_attention
from megatron_earl.models.tree_attention import Row, plan_tree_attention
from megatron_earl.training.microbatch import (
    next_token_sample,
    num_sample_tokens,
    real_tokens,
    unpack_per_sample,
)
from megatron_earl.training.prefix_tree import plan_tree, shared_prefixes, tree_micro_batch


def _sample(prompt, answer, trainable=True):
    tokens = torch.tensor([*prompt, *answer])
    generated = (torch.arange(tokens.numel()) >= len(prompt)) & trainable
    return next_token_sample(tokens, generated, rollout_logprobs=torch.randn(tokens.numel()))


SAMPLES = [
    _sample((1, 2, 3, 4), (9, 9)),  # 0: group A
    _sample((5, 6), (7,)),  # 1: alone (no partner)
    _sample((1, 2, 3, 4), (8, 7, 6)),  # 2: group A
    _sample((1, 2, 3, 4), (5,), trainable=False),  # 3: nothing to train: whole
    _sample((1, 2, 3), (4, 2)),  # 4: same tokens as A, but trains from position 2: group B
    _sample((1, 2, 3, 4), (1,)),  # 5: group A
    _sample((1, 2, 3), (4, 4)),  # 6: group B
    _sample((), (3, 3)),  # 7: trains from position 0: nothing to share
    _sample((), (3, 3)),  # 8: same
]


def _fields(samples):
    return {k: torch.cat([s[k] for s in samples]) for k in samples[0]}


def _lengths(samples):
    return [s["tokens"].numel() for s in samples]


def test_shared_prefixes_groups_equal_prompts_up_to_the_first_trainable_position():
    fields = _fields(SAMPLES)
    groups, prefix = shared_prefixes(fields["tokens"], fields["loss_mask"], _lengths(SAMPLES))
    assert groups == [[0, 2, 5], [1], [3], [4, 6], [7], [8]]
    # A's first trainable position is 3 (predicting the first answer token): 3 shared tokens
    assert prefix == [3, 0, 0, 2, 0, 0]


def test_the_tree_row_maps_back_to_every_sample_token():
    fields, lengths = _fields(SAMPLES), _lengths(SAMPLES)
    mb = tree_micro_batch(fields, lengths, sample_index=range(10, 19))
    # group A saves 2 x 3 tokens, group B 1 x 2
    assert mb["tokens"].numel() == sum(lengths) - 6 - 2
    assert num_sample_tokens(mb) == sum(lengths)
    for name in ("tokens", "labels", "loss_mask", "rollout_logprobs"):
        back = real_tokens(mb[name], mb)
        trainable = fields["loss_mask"] != 0
        if name == "rollout_logprobs":  # a prefix holds its first sample's (masked) values
            back, want = back[trainable], fields[name][trainable]
        else:
            want = fields[name]
        torch.testing.assert_close(back, want.to(back.dtype), rtol=0, atol=0)
    pieces = unpack_per_sample(mb["tokens"], mb)
    assert [p.tolist() for p in pieces] == [s["tokens"].tolist() for s in SAMPLES]
    # positions continue the prefix in every branch; every token is in its sample's slot
    layout = plan_tree(lengths, [[0, 2, 5], [1], [3], [4, 6], [7], [8]], [3, 0, 0, 2, 0, 0])
    assert layout.positions[:3].tolist() == [0, 1, 2]
    assert layout.positions[3:6].tolist() == [3, 4, 5]  # sample 0's branch
    slots = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    trainable = fields["loss_mask"] != 0  # a prefix token is its group's first sample's
    assert torch.equal(mb["seq_ids"][0, layout.unshared_index][trainable], slots[trainable])
    assert mb["sample_index"].tolist() == list(range(10, 19))


def test_sequence_parallel_padding_ends_the_row():
    samples = [s for i, s in enumerate(SAMPLES) if i != 1]
    fields, lengths = _fields(samples), _lengths(samples)
    row = sum(lengths) - 8  # odd
    mb = tree_micro_batch(fields, lengths, sp=2)
    assert row % 2 == 1 and mb["tokens"].numel() == row + 1
    assert float(mb["loss_mask"][0, -1]) == 0.0
    assert real_tokens(mb["tokens"], mb).tolist() == fields["tokens"].tolist()


def _brute_force_mask(rows, total):
    """[t, t] allowed(query, key) of a tree row."""
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for r in rows:
        own = list(range(*r.own))
        for j, q in enumerate(own):
            allowed[q, list(range(*r.prefix))] = True
            allowed[q, own[: j + 1]] = True
    return allowed


def _planned_mask(plan, rows, total):
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for b in plan.batches:
        num_rows, width = b.queries.shape
        mask = b.mask
        if mask is None:  # causal over the row's own (right-padded) tokens
            mask = torch.ones(width, width, dtype=torch.bool).tril().expand(num_rows, 1, -1, -1)
        for pick, token in zip(b.picks.tolist(), b.tokens.tolist(), strict=True):
            r, j = divmod(pick, width)
            assert int(b.queries[r, j]) == token
            allowed[token, b.keys[r][mask[r, 0, j]]] = True
    for r in plan.large:
        allowed |= _brute_force_mask([r], total)
    return allowed


@pytest.mark.parametrize("max_elements", [1 << 22, 40, 12])
def test_tree_attention_plan_equals_the_tree_mask(monkeypatch, max_elements):
    monkeypatch.setattr(tree_attention, "MASK_ELEMENTS", max_elements)
    rows = [
        Row((0, 0), (0, 3)),  # a prefix
        Row((0, 3), (3, 5)),
        Row((0, 3), (5, 11)),
        Row((11, 11), (11, 15)),  # a plain sample
        Row((11, 11), (15, 16)),
        Row((16, 16), (16, 18)),  # another prefix
        Row((16, 18), (18, 19)),
    ]
    plan = plan_tree_attention(rows)
    assert torch.equal(_planned_mask(plan, rows, 19), _brute_force_mask(rows, 19))
    planned = sorted(t for b in plan.batches for t in b.tokens.tolist())
    planned += [t for r in plan.large for t in range(*r.own)]
    assert sorted(planned) == list(range(19))  # every query exactly once
    for b in plan.batches:
        assert b.queries.numel() * b.keys.size(1) <= max_elements
        if b.mask is None:  # rows without a prefix: as many keys as queries
            assert b.keys.size(1) == b.queries.size(1)
    if max_elements == 12:  # rows over 12 [query, key] pairs attend alone
        assert {r.own for r in plan.large} == {(5, 11), (11, 15)}


@pytest.mark.parametrize("seed", range(12))
def test_random_trees_plan_their_tree_mask(monkeypatch, seed):
    """Random rows (prefixes of 0-9 tokens, 1-6 branches of 0-12 tokens each, and plain
    samples), batched under a random budget: the plan's mask is the tree's, every query once,
    every batch within the budget."""
    gen = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    monkeypatch.setattr(tree_attention, "MASK_ELEMENTS", draw(8, 400))
    rows, end = [], 0
    for _ in range(draw(1, 5)):
        f = draw(0, 9)
        if f:
            rows.append(Row((end, end), (end, end + f)))
        prefix, end = (end, end + f), end + f
        for _ in range(draw(1, 6)):
            n = draw(0, 12)
            rows.append(Row(prefix, (end, end + n)))
            end += n
    plan = plan_tree_attention(rows)
    assert torch.equal(_planned_mask(plan, rows, end), _brute_force_mask(rows, end))
    planned = [t for b in plan.batches for t in b.tokens.tolist()]
    planned += [t for r in plan.large for t in range(*r.own)]
    assert sorted(planned) == list(range(end))
    for b in plan.batches:  # padding repeats real indices: every gather stays in the row
        for index in (b.queries, b.keys):
            assert 0 <= int(index.min()) and int(index.max()) < end
        assert b.queries.numel() * b.keys.size(1) <= tree_attention.MASK_ELEMENTS
        if b.mask is None:
            assert b.keys.size(1) == b.queries.size(1)


def test_plan_tree_refuses_groups_that_are_not_a_partition_or_prefixes_too_long():
    with pytest.raises(ValueError, match=r"not a partition of 3 samples"):
        plan_tree([4, 4, 4], [[0, 1]], [0])
    with pytest.raises(ValueError, match=r"prefix of 4 tokens for samples of lengths \[4, 5\]"):
        plan_tree([4, 5], [[0, 1]], [4])
    with pytest.raises(ValueError, match="at least one sample"):
        tree_micro_batch({"tokens": torch.zeros(0), "loss_mask": torch.zeros(0)}, [])
