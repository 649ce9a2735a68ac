"""``bench engine --floor`` splits a prefill run into the steps the engine's admission makes:
as many fresh sequences per step as keep it within ``max_prefill_tokens`` padded tokens, at least
one (a prompt over the budget is prefilled alone), in order, every sequence once."""

from __future__ import annotations

import pytest

from megatron_earl.bench.engine_floor import prefill_steps


@pytest.mark.parametrize(
    ("sequences", "prompt_len", "budget", "steps"),
    [
        (64, 32, 8192, [64]),  # the bench's default: one step
        (64, 256, 8192, [32, 32]),
        (10, 1000, 3000, [3, 3, 3, 1]),
        (3, 9000, 8192, [1, 1, 1]),  # each prompt over the budget: alone
        (1, 32, 8192, [1]),
    ],
)
def test_prefill_steps_follow_the_token_budget(sequences, prompt_len, budget, steps):
    assert prefill_steps(sequences, prompt_len, budget) == steps
    assert sum(steps) == sequences
