"""The colocation endpoints of ``megatron-earl serve``: SGLang's memory release and resume.

    POST /release_memory_occupation  {tags: ["kv_cache", "weights", "cuda_graph"] | null, rid}
    POST /resume_memory_occupation   {tags: [...] | null, rid}      -> 200, body null (SGLang's)

``MemoryEndpoints`` is mixed into ``server.Server`` (it uses the server's ``engine``, ``_json``
and ``_update_lock``). What each tag does here (``memory_occupation``): ``kv_cache`` drops the
engine's KV-cache tensors (and its parked sessions, as SGLang flushes its cache), ``weights``
moves the parameters' values to a host backup and leaves empty parameters (SGLang with
``--enable-weights-cpu-backup``; without it SGLang's resumed weights hold no defined values, so
a trainer pushes weights after resuming them, as ours does), ``cuda_graph`` frees nothing (no
graphs on CPU) but is tracked like the others. ``/get_server_info`` reports
``released_memory``, ``kv_cache_bytes``, ``weight_bytes`` and ``weight_backup_bytes``.

Rules (SGLang's, made explicit):

- ``tags`` null or ``[]`` means every tag; an unknown tag is a 400 naming it and the valid ones;
- release needs an idle engine (SGLang asserts it): a request running, or waiting while
  generation is not paused, makes it a 400 and nothing is released;
- a tag released twice, or resumed while not released, is a 400 naming it (SGLang fails there
  too, less clearly); nothing changes;
- while any tag is released, ``/generate`` answers 503 (SGLang does not guard this: its kernels
  would read freed memory); requests queued before a release while paused stay queued until
  every tag is resumed and ``continue_generation``;
- a weight update while ``weights`` is released is a 400 (resume ``weights`` first); release and
  resume wait for a weight update in progress.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from megatron_earl.config.vocab import MemoryTag
from megatron_earl.rollout.embedded.memory_occupation import MEMORY_FIELDS, parse_tags
from megatron_earl.rollout.serve.auth import error_response
from megatron_earl.rollout.serve.generate_api import BadRequest


class MemoryEndpoints:
    """SGLang's release/resume of memory occupation (module docstring); mixed into ``Server``."""

    async def _tags(self, request: web.Request, what: str) -> tuple[MemoryTag, ...]:
        body = await self._json(request, MEMORY_FIELDS, what)
        try:
            return parse_tags(body.get("tags"))
        except ValueError as err:
            raise BadRequest(f"{what}: {err}") from None

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = await self._tags(request, "release_memory_occupation")
        async with self._update_lock:
            await self.engine.release_memory_occupation(tags)
        return web.json_response(None)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = await self._tags(request, "resume_memory_occupation")
        async with self._update_lock:
            await self.engine.resume_memory_occupation(tags)
        return web.json_response(None)

    def memory_info(self) -> dict[str, Any]:
        """What ``/get_server_info`` reports about memory: the released tags and the bytes the
        KV cache, the weights and the weights' host backup hold."""
        return {"released_memory": list(self.engine.released), **self.engine.memory_bytes()}

    def released_response(self) -> web.Response | None:
        """503 for ``/generate`` while memory is released, else None."""
        released = self.engine.released
        if not released:
            return None
        return error_response(
            503,
            f"memory {list(released)} is released (release_memory_occupation); generation "
            "resumes after resume_memory_occupation",
        )

    def check_weights_resident(self, what: str) -> None:
        """``BadRequest`` when the weights are released (an update has nothing to load into)."""
        if MemoryTag.WEIGHTS in self.engine.released:
            raise BadRequest(
                f"{what} refused, nothing changed: the weights are released "
                "(release_memory_occupation); resume_memory_occupation with tags ['weights'] "
                "first"
            )
