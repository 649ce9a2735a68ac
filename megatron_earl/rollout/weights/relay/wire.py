"""What a relay's HTTP clients and its server agree on, without importing the server: the
environment variable holding the relay's API key, and the header carrying a bucket's SHA-256.
(The trainer's publisher and each rank's repack placement talk to relays; ``relay/server.py``
serves them.)"""

from __future__ import annotations

import os

API_KEY_ENV = "EARL_RELAY_API_KEY"
"""Environment variable with the relays' API key (``Authorization: Bearer``); unset: none."""
SHA_HEADER = "X-Sha256"
"""Header of a bucket upload/download: the hex SHA-256 of its bytes."""


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer`` with the key of ``API_KEY_ENV`` (empty when it is unset)."""
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}
