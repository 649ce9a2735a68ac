"""The embedded engine's prefill index tensors (``embedded.step.StepIndex.build``): written
out by hand for a step with a cached prefix, a shared row and prompt log-probs, and against a
loop over every token on random steps."""

from __future__ import annotations

import random

import torch

from megatron_earl.rollout.embedded.step import Batch, StepIndex


def _lists(index: StepIndex) -> dict[str, list[int]]:
    assert all(t.dtype == torch.long and t.dim() == 1 for t in index.tensors)
    return {name: t.tolist() for name, t in index.tensors._asdict().items()}


def test_index_of_a_step_with_shared_rows_and_prompt_logprobs():
    # Sequence 0: 3 new tokens after 2 cached, in row 3, keys also to row 4, logits from its
    # 2nd token; sequence 1: 2 fresh tokens in row 0, logits from its 1st.
    batch = Batch((3, 0), ((7, 8, 9), (5, 6)), (2, 0), shared=((4,), ()), logits_from=(1, 0))
    index = StepIndex.build(batch)
    assert _lists(index) == {
        "ids": [7, 8, 9, 5, 6],
        "pos": [2, 3, 4, 0, 1],
        "seq": [0, 0, 0, 1, 1],
        "local": [0, 1, 2, 0, 1],
        "last": [1, 2, 3, 4],
        "start": [2, 0],
        "rows": [3, 0],
        "w_rows": [3, 3, 3, 4, 4, 4, 0, 0],
        "w_pos": [2, 3, 4, 2, 3, 4, 0, 1],
        "w_src": [0, 1, 2, 0, 1, 2, 3, 4],
        "width": [0, 1, 2],
        "slot": [0, 1, 2, 3, 4, 4],  # sequence 1's 3rd slot is padding: its last token again
        "key_pos": [0, 1, 2, 3, 4],
    }
    assert (index.fresh, index.max_new, index.max_key_len, index.shared) == (False, 3, 5, True)


def test_index_of_fresh_sequences_returning_their_last_token():
    index = StepIndex.build(Batch((1, 0, 2), ((4,), (5, 6, 7), (8, 9)), (0, 0, 0)))
    lists = _lists(index)
    assert lists["last"] == [0, 3, 5]
    assert lists["w_rows"] == [1, 0, 0, 0, 2, 2] and lists["w_src"] == list(range(6))
    assert lists["pos"] == lists["local"] == [0, 0, 1, 2, 0, 1]
    assert lists["slot"] == [0, 0, 0, 1, 2, 3, 4, 5, 5]
    assert (index.fresh, index.max_new, index.max_key_len, index.shared) == (True, 3, 3, False)


def _reference(batch: Batch) -> dict[str, list[int]]:
    """The index lists by a loop over every token (the engine's code before it used numpy)."""
    out = {name: [] for name in ("ids", "pos", "seq", "local", "last")}
    out.update(start=list(batch.starts), rows=list(batch.rows), w_rows=[], w_pos=[], w_src=[])
    shared = batch.shared or ((),) * len(batch.tokens)
    total = 0
    for s, (row, start, tokens) in enumerate(zip(batch.rows, batch.starts, batch.tokens)):
        n = len(tokens)
        out["ids"] += tokens
        out["pos"] += range(start, start + n)
        out["seq"] += [s] * n
        out["local"] += range(n)
        for target in (row, *shared[s]):
            out["w_rows"] += [target] * n
            out["w_pos"] += range(start, start + n)
            out["w_src"] += range(total, total + n)
        first = batch.logits_from[s] if batch.logits_from else n - 1
        out["last"] += range(total + first, total + n)
        total += n
    width = max(len(t) for t in batch.tokens)
    out["width"] = list(range(width))
    firsts = [sum(len(t) for t in batch.tokens[:s]) for s in range(len(batch.tokens))]
    out["slot"] = [
        first + min(j, len(t) - 1) for first, t in zip(firsts, batch.tokens) for j in range(width)
    ]
    key_len = max(start + len(t) for start, t in zip(batch.starts, batch.tokens))
    out["key_pos"] = list(range(key_len))
    return out


def test_index_matches_a_per_token_loop_on_random_steps():
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 6)
        rows = rng.sample(range(16), k)
        free = [r for r in range(16) if r not in rows]
        tokens = tuple(tuple(rng.randrange(50) for _ in range(rng.randint(1, 5))) for _ in rows)
        shared = ()
        if rng.random() < 0.5:  # any sequence may share with 0-2 further rows
            shared = tuple(tuple(free.pop() for _ in range(rng.randint(0, 2))) for _ in rows)
        logits_from = tuple(rng.randrange(len(t)) for t in tokens) if rng.random() < 0.5 else ()
        starts = tuple(rng.randint(0, 9) for _ in rows)
        batch = Batch(tuple(rows), tokens, starts, shared, logits_from)
        index = StepIndex.build(batch)
        assert _lists(index) == _reference(batch), batch
        # What the attention relies on: token t sits in its sequence's slot at its local index,
        # and a padding slot repeats its sequence's last token.
        t = index.tensors
        slots = t.slot.view(len(rows), -1)
        assert torch.equal(slots[t.seq, t.local], torch.arange(t.seq.numel()))
        lengths = torch.tensor([len(x) for x in tokens])
        pad = t.width[None, :] >= lengths[:, None]
        last = (torch.cumsum(lengths, 0) - 1)[:, None].expand_as(slots)
        assert torch.equal(slots[pad], last[pad])
