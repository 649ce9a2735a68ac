"""What every HTTP server of the project (``serve``, the relay, the reward service) checks before
a handler runs, in one place so that the three cannot drift apart.

* ``bearer_matches``: ``Authorization: Bearer KEY``, compared in constant time.
* ``route_path``: the path a request's *route* was registered with (``/versions/{v}/commit``),
  or None when no route matched. Key decisions read this, never the raw request path: an
  encoded slash, a dot segment or a prefix such as ``/health%2F..%2Fgenerate`` cannot put a
  request under another route's rule, and a route registered for every method is keyed like
  any other.
* ``parse_json``: a request body as JSON; a body nested deeper than the parser's recursion
  limit (Python's ``json`` raises ``RecursionError`` past ~1,000 levels) is the client's
  malformed input (``ValueError``), not the server's crash.

Routes are registered for the methods they take, never ``*``: ``OPTIONS`` (checked for the key
like every method) then matches no handler and aiohttp answers it 405 with ``Allow``, as SGLang
does.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from aiohttp import web


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether ``header`` is ``Bearer <key>`` (scheme case-insensitive, key in constant time)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def route_path(request: web.Request) -> str | None:
    """The registered path of the route ``request`` matched; None for no route (404) or a
    method the route does not take (405)."""
    resource = request.match_info.route.resource
    return None if resource is None else resource.canonical


def parse_json(raw: bytes | str, what: str) -> Any:
    """``raw`` parsed as JSON; ``ValueError`` naming ``what`` when it is not JSON, not UTF-8, or
    nested deeper than the parser can follow."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"malformed JSON in {what}: {err}") from None
    except RecursionError:
        raise ValueError(
            f"{what} is nested too deeply to parse (JSON nesting is limited to ~1,000 levels)"
        ) from None
