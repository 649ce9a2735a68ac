"""A cache of torch.distributed process groups keyed by rank set, backend and options.

Switching layouts asks for the same rank sets again and again (tp2 <-> dp2 <-> tp2 ...). Without a
cache every switch calls ``new_group`` for every group Megatron builds, and each gloo group costs
threads, sockets and memory that ``destroy_model_parallel()`` never gives back. With it, a rank set
that was asked for before returns the existing group object, so:

* switching back to a layout used before creates no new group and runs no collective;
* a model built in layout A keeps working after A -> B -> A: the groups its modules captured are
  the very objects the cache returns for A again (the cache keeps them alive).

Key: ``(sorted ranks, backend, options)``. ``backend=None`` resolves to the world's backend, so on a
gloo world Megatron's "gloo" variants and the default-backend groups of the same ranks are one
group. Groups of different purposes but equal ranks (e.g. Megatron's tp and mp groups when pp = 1)
share one group too: every rank issues collectives on them in the same program order, so sharing
is safe; on NCCL it serialises what separate communicators could overlap (see docs/layouts.md).
The timeout is not part of the key: the first request's timeout wins.

Order: torch requires every rank of the world to call ``new_group`` for every group, in the same
order, members or not. ``GroupCache.get`` records non-member results
(``GroupMember.NON_GROUP_MEMBER``) too, so the cache holds the same keys on every rank, and a
miss -- the only case that calls ``new_group`` -- happens at the same call on every rank, provided
callers ask for groups in an order derived only from the layout (``megatron_earl.parallel.state``
asks in the order of Megatron's ``initialize_model_parallel``, which depends only on the layout).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

GroupKey = tuple[tuple[int, ...], str, tuple[Any, ...] | None]
"""(sorted member ranks, backend name, options key or None)."""

_NCCL_CONFIG_FIELDS = ("cga_cluster_size", "max_ctas", "min_ctas", "net_name")


@dataclass
class CacheStats:
    """Counters of one ``GroupCache``."""

    created: int = 0
    """``new_group`` calls made (members and non-members alike)."""
    hits: int = 0
    """Requests answered from the cache."""


def options_key(pg_options: Any) -> tuple[Any, ...] | None:
    """A hashable key for process-group options (None, or NCCL options as Megatron builds them)."""
    if pg_options is None:
        return None
    if hasattr(pg_options, "is_high_priority_stream") and hasattr(pg_options, "config"):
        config = pg_options.config
        fields = tuple(getattr(config, name, None) for name in _NCCL_CONFIG_FIELDS)
        return ("nccl", bool(pg_options.is_high_priority_stream), *fields)
    raise TypeError(
        f"cannot key process-group options of type {type(pg_options).__name__}; supported: None "
        "and NCCL options (is_high_priority_stream + config)"
    )


class GroupCache:
    """Process groups by ``(ranks, backend, options)``; created once, destroyed only by ``destroy``.

    Which ranks call: ``get`` must be called by every rank of the world with the same arguments in
    the same order (a miss calls ``torch.distributed.new_group``, a collective over the world);
    ``destroy`` likewise.
    """

    def __init__(self) -> None:
        self._groups: dict[GroupKey, Any] = {}
        self._created: list[Any] = []
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._groups)

    def key(self, ranks: Iterable[int], backend: str | None = None, pg_options: Any = None):
        """The cache key of a request (``backend=None`` means the world's backend)."""
        members = tuple(sorted(int(r) for r in ranks))
        if len(set(members)) != len(members):
            raise ValueError(f"process group ranks {members} contain duplicates")
        name = str(backend) if backend is not None else str(dist.get_backend())
        return (members, name.lower(), options_key(pg_options))

    def get(
        self,
        ranks: Iterable[int],
        *,
        backend: str | None = None,
        pg_options: Any = None,
        timeout: datetime.timedelta | None = None,
        group_desc: str | None = None,
    ) -> Any:
        """The group of ``ranks`` (``GroupMember.NON_GROUP_MEMBER`` on ranks outside it).

        Every rank of the world calls it, in the same order (see the class docstring).
        """
        key = self.key(ranks, backend, pg_options)
        group = self._groups.get(key)
        if group is not None:
            if self._is_member(key) and group not in dist.distributed_c10d._world.pg_map:
                raise RuntimeError(
                    f"cached process group of ranks {list(key[0])} ({key[1]}) was destroyed "
                    "outside the cache (megatron's destroy_model_parallel() destroys gloo "
                    "groups); tear down with megatron_earl.parallel.state.destroy_layouts()"
                )
            self.stats.hits += 1
            return group
        group = dist.new_group(
            ranks=list(key[0]),
            timeout=timeout,
            backend=backend,
            pg_options=pg_options,
            group_desc=group_desc,
        )
        self.stats.created += 1
        self._groups[key] = group
        if self._is_member(key):
            self._created.append(group)
        return group

    def member_groups(self) -> list[Any]:
        """The groups this rank belongs to, in creation order."""
        return list(self._created)

    def keys(self) -> list[GroupKey]:
        """Every key held (the same list, in the same order, on every rank)."""
        return list(self._groups)

    def destroy(self) -> None:
        """Destroy exactly the groups this cache created and forget every entry.

        Every rank of the world calls it. Groups destroyed elsewhere already are skipped.
        """
        live = dist.distributed_c10d._world.pg_map
        for group in reversed(self._created):
            if group in live:
                dist.destroy_process_group(group)
        self._groups.clear()
        self._created.clear()

    @staticmethod
    def _is_member(key: GroupKey) -> bool:
        return dist.get_rank() in key[0]


_CACHE = GroupCache()


def group_cache() -> GroupCache:
    """This process's cache (one per process; ``megatron_earl.parallel.state`` uses it)."""
    return _CACHE
