"""``relay.readback``: which buckets a relay reads back after a load, and when an engine's
``get_weights_by_name`` answer holds the published values; ``--verify-tensors`` and ``serve``'s
fault injection (``$EARL_SERVE_FAULT_CORRUPT_LOADS``) are checked."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.rollout.serve import server as serve
from megatron_earl.rollout.weights.relay.readback import (
    VERIFY_ROWS,
    read_back_matches,
    sampled_buckets,
)
from megatron_earl.rollout.weights.relay.server import RelaySettings, parse_args, settings_from_args


@pytest.mark.parametrize(
    ("num_buckets", "num_tensors", "expected"),
    [
        (12, 4, {0, 4, 7, 11}),
        (12, 2, {0, 11}),
        (12, 1, {0}),
        (3, 4, {0, 1, 2}),
        (1, 4, {0}),
        (12, 0, set()),
        (0, 4, set()),
    ],
)
def test_sampled_buckets_spread_over_the_version(num_buckets, num_tensors, expected):
    assert sampled_buckets(num_buckets, num_tensors) == expected


def test_a_read_back_matches_only_the_published_values():
    gen = torch.Generator().manual_seed(0)
    matrix = torch.randn(8, 5, generator=gen)[:VERIFY_ROWS]
    vector = torch.randn(6, generator=gen)[:VERIFY_ROWS]
    for want in (matrix, vector, matrix.to(torch.bfloat16)):
        got = want.to(torch.float32).tolist()  # SGLang's answer
        assert read_back_matches(got, want)
        assert read_back_matches([got, got], want)  # one list per DP rank
        assert not read_back_matches((want.float() + 1.0).tolist(), want)
        assert not read_back_matches([got, (want.float() + 1.0).tolist()], want)
    # an engine holding bfloat16 of float32 weights: the published values rounded
    assert read_back_matches(matrix.to(torch.bfloat16).float().tolist(), matrix)
    off = matrix.clone()
    off[0, 0] = torch.nextafter(off[0, 0], torch.tensor(10.0))  # one ulp: not a rounding
    assert not read_back_matches(off.tolist(), matrix)
    assert not read_back_matches(matrix[:1].tolist(), matrix)  # other shape
    assert not read_back_matches([[1.0], [2.0, 3.0]], matrix)  # ragged
    assert not read_back_matches(None, matrix)


def test_the_sample_size_and_the_fault_injection_are_checked(monkeypatch, capsys):
    assert settings_from_args(parse_args(["--port", "1"])).verify_tensors == 4
    assert (
        settings_from_args(parse_args(["--port", "1", "--verify-tensors", "0"])).verify_tensors == 0
    )
    with pytest.raises(ValueError, match=r"verify_tensors must be >= 0 .* got -1"):
        RelaySettings(verify_tensors=-1)
    monkeypatch.setenv(serve.FAULT_CORRUPT_LOADS_ENV, "2")
    assert serve.parse_args([]).corrupt_loads == 2
    monkeypatch.setenv(serve.FAULT_CORRUPT_LOADS_ENV, "one")
    with pytest.raises(SystemExit):
        serve.parse_args([])
    assert "EARL_SERVE_FAULT_CORRUPT_LOADS must be an integer >= 0 (0: off), got 'one'" in (
        capsys.readouterr().err
    )
