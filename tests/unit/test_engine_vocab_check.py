"""The embedded engine's vocabulary check of a request's token ids (``embedded._outside_vocab``):
the same ids, in order, as checking every id, with its min/max shortcut."""

from __future__ import annotations

import random

import numpy as np

from megatron_earl.rollout.embedded import _outside_vocab


def test_outside_vocab_matches_an_id_by_id_check():
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randint(-3, 323) for _ in range(rng.randint(1, 40))]
        assert _outside_vocab(ids, 320) == [t for t in ids if not 0 <= t < 320], ids


def test_outside_vocab_on_edges_and_numpy_ids():
    assert _outside_vocab((0, 319), 320) == []
    assert _outside_vocab((5, 320, -1, 7), 320) == [320, -1]
    assert _outside_vocab(tuple(np.array([3, 400], dtype=np.int64)), 320) == [400]
