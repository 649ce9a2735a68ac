"""The embedded engine's prefill index tensors (``batched_forward._StepIndex.build``), written
out by hand for a step with a cached prefix, a shared row and prompt log-probs."""

from __future__ import annotations

import torch

from megatron_earl.rollout.batched_forward import Batch, _StepIndex


def _lists(index: _StepIndex) -> dict[str, list[int]]:
    assert all(t.dtype == torch.long and t.dim() == 1 for t in index.tensors)
    return {name: t.tolist() for name, t in index.tensors._asdict().items()}


def test_index_of_a_step_with_shared_rows_and_prompt_logprobs():
    # Sequence 0: 3 new tokens after 2 cached, in row 3, keys also to row 4, logits from its
    # 2nd token; sequence 1: 2 fresh tokens in row 0, logits from its 1st.
    batch = Batch((3, 0), ((7, 8, 9), (5, 6)), (2, 0), shared=((4,), ()), logits_from=(1, 0))
    index = _StepIndex.build(batch)
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
        "key_pos": [0, 1, 2, 3, 4],
    }
    assert (index.fresh, index.max_new, index.max_key_len, index.shared) == (False, 3, 5, True)


def test_index_of_fresh_sequences_returning_their_last_token():
    index = _StepIndex.build(Batch((1, 0, 2), ((4,), (5, 6, 7), (8, 9)), (0, 0, 0)))
    lists = _lists(index)
    assert lists["last"] == [0, 3, 5]
    assert lists["w_rows"] == [1, 0, 0, 0, 2, 2] and lists["w_src"] == list(range(6))
    assert lists["pos"] == lists["local"] == [0, 0, 1, 2, 0, 1]
    assert (index.fresh, index.max_new, index.max_key_len, index.shared) == (True, 3, 3, False)
