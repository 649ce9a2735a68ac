"""``serve``'s authorization decisions equal SGLang 0.5.23's ``decide_request_auth`` table
(health/ready/metrics open; admin endpoints: admin key, else API key; the rest: API key) but for
one cell: the method never opens a route (SGLang lets ``OPTIONS`` through unchecked). A request
that matched no route (path None) needs the API key. The body limits pick the weight limit only
for weight updates."""

from __future__ import annotations

import pytest

from megatron_earl.rollout.serve.auth import RequestLimits, allowed

K, A = "k-1", "admin-2"
CASES = [
    # route path, header, api_key, admin_key, allowed
    ("/health", None, K, A, True),
    ("/health_generate", None, K, None, True),
    ("/metrics", None, K, None, True),
    (None, None, K, None, False),  # no route matched (404/405): keyed all the same
    (None, None, None, A, True),
    ("/generate", None, K, None, False),
    ("/generate", f"Bearer {K}", K, None, True),
    ("/generate", f"bearer {K}", K, None, True),
    ("/generate", f"Bearer {K}x", K, None, False),
    ("/generate", K, K, None, False),
    ("/get_model_info", None, K, None, False),
    ("/generate", None, None, A, True),  # an admin key alone leaves normal paths open
    ("/generate", None, None, None, True),
    ("/update_weights_from_disk", None, None, None, True),
    ("/update_weights_from_disk", f"Bearer {K}", K, None, True),
    ("/update_weights_from_disk", None, K, None, False),
    ("/update_weights_from_disk", f"Bearer {K}", K, A, False),  # admin key required
    ("/update_weights_from_disk", f"Bearer {A}", K, A, True),
    ("/pause_generation", f"Bearer {A}", None, A, True),
    ("/abort_request", None, None, A, False),
]


@pytest.mark.parametrize("path,header,api_key,admin_key,expected", CASES)
def test_decisions_match_sglang(path, header, api_key, admin_key, expected):
    assert allowed(path, header, api_key, admin_key) is expected


def test_limits():
    limits = RequestLimits(max_body_bytes=4096, max_weight_body_bytes=1 << 20)
    assert limits.for_path("/generate") == 4096
    assert limits.for_path("/update_weights_from_tensor") == 1 << 20
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1024"):
        RequestLimits(max_body_bytes=10)
