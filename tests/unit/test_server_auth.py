"""``serve``'s authorization decisions equal SGLang 0.5.23's ``decide_request_auth`` table
(health/ready/metrics open; admin endpoints: admin key, else API key; the rest: API key), and the
body limits pick the weight limit only for weight updates."""

from __future__ import annotations

import pytest

from megatron_earl.rollout.server_auth import RequestLimits, allowed

K, A = "k-1", "admin-2"
CASES = [
    # method, path, header, api_key, admin_key, allowed
    ("GET", "/health", None, K, A, True),
    ("GET", "/health_generate", None, K, None, True),
    ("GET", "/metrics", None, K, None, True),
    ("OPTIONS", "/generate", None, K, None, True),
    ("POST", "/generate", None, K, None, False),
    ("POST", "/generate", f"Bearer {K}", K, None, True),
    ("POST", "/generate", f"bearer {K}", K, None, True),
    ("POST", "/generate", f"Bearer {K}x", K, None, False),
    ("POST", "/generate", K, K, None, False),
    ("GET", "/get_model_info", None, K, None, False),
    ("POST", "/generate", None, None, A, True),  # an admin key alone leaves normal paths open
    ("POST", "/generate", None, None, None, True),
    ("POST", "/update_weights_from_disk", None, None, None, True),
    ("POST", "/update_weights_from_disk", f"Bearer {K}", K, None, True),
    ("POST", "/update_weights_from_disk", None, K, None, False),
    ("POST", "/update_weights_from_disk", f"Bearer {K}", K, A, False),  # admin key required
    ("POST", "/update_weights_from_disk", f"Bearer {A}", K, A, True),
    ("POST", "/pause_generation", f"Bearer {A}", None, A, True),
    ("POST", "/abort_request", None, None, A, False),
]


@pytest.mark.parametrize("method,path,header,api_key,admin_key,expected", CASES)
def test_decisions_match_sglang(method, path, header, api_key, admin_key, expected):
    assert allowed(method, path, header, api_key, admin_key) is expected


def test_limits():
    limits = RequestLimits(max_body_bytes=4096, max_weight_body_bytes=1 << 20)
    assert limits.for_path("/generate") == 4096
    assert limits.for_path("/update_weights_from_tensor") == 1 << 20
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1024"):
        RequestLimits(max_body_bytes=10)
