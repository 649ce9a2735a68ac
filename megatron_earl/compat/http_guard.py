"""What every HTTP server of the project (``serve``, the relay, the reward service) checks before
a handler runs, in one place so that the three cannot drift apart.

* ``bearer_matches``: ``Authorization: Bearer KEY``, compared in constant time.
* ``route_path``: the path a request's *route* was registered with (``/versions/{v}/commit``),
  or None when no route matched. Key decisions read this, never the raw request path: an
  encoded slash, a dot segment or a prefix such as ``/health%2F..%2Fgenerate`` cannot put a
  request under another route's rule, and a route registered for every method is keyed like
  any other.
* ``read_body``: a request's body, at most ``limit`` bytes (413 past it, with or without a
  ``Content-Length``), into a buffer nothing else keeps (aiohttp's ``request.read()`` caches the
  body on the request for the handler's whole life).
* ``parse_json``: a request body as JSON; a body nested deeper than the parser's recursion
  limit (Python's ``json`` raises ``RecursionError`` past ~1,000 levels) is the client's
  malformed input (``ValueError``), not the server's crash. Given a ``bytearray`` it empties it
  once decoded, so a body of B bytes peaks at 2B while parsing (the text and what it parses to),
  not 3B (``json.loads`` of bytes keeps the bytes, their decoded text and the result).

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


async def read_body(request: web.Request, limit: int, in_place: bool = False) -> bytearray:
    """The body of ``request``; ``HTTPRequestEntityTooLarge`` once it passes ``limit`` bytes.

    By default memory grows as bytes arrive (a stalled sender holds only what it sent) and the
    chunks are joined at the end: ~2x the body for that moment, and the freed chunks may stay in
    the allocator's heap. ``in_place`` (a body with a ``Content-Length``) allocates the whole
    buffer first and fills it: 1x, for a caller that lets one such body in at a time."""
    length = request.content_length
    if in_place and length is not None and length <= limit:
        body, filled = bytearray(length), 0
        with memoryview(body) as view:
            async for chunk in request.content.iter_chunked(1 << 20):  # at most length bytes
                view[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
        return body
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        chunks.append(chunk)
    body = bytearray().join(chunks)
    chunks.clear()
    return body


def parse_json(raw: bytes | bytearray | str, what: str) -> Any:
    """``raw`` parsed as JSON (a ``bytearray`` is emptied once decoded: module docstring);
    ``ValueError`` naming ``what`` when it is not JSON, not UTF-8, or nested deeper than the
    parser can follow."""
    try:
        if isinstance(raw, bytearray):  # the encodings json.loads reads (a BOM, UTF-16/32)
            text = raw.decode(json.detect_encoding(raw), "surrogatepass")
            raw.clear()
            return json.loads(text)
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"malformed JSON in {what}: {err}") from None
    except RecursionError:
        raise ValueError(
            f"{what} is nested too deeply to parse (JSON nesting is limited to ~1,000 levels)"
        ) from None
