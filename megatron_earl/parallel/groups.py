"""A cache of torch.distributed process groups keyed by rank set, role and options; every device
group with its host (gloo) twin.

Switching layouts asks for the same rank sets again and again (tp2 <-> dp2 <-> tp2 ...). Without a
cache every switch calls ``new_group`` for every group Megatron builds, and each group costs
threads, sockets and memory (an NCCL communicator: GPU memory and an init of hundreds of ms to
seconds at scale) that ``destroy_model_parallel()`` never gives back. With it, a rank set that was
asked for before returns the existing group object, so:

* switching back to a layout used before creates no new group and runs no collective;
* a model built in layout A keeps working after A -> B -> A: the groups its modules captured are
  the very objects the cache returns for A again (the cache keeps them alive).

Roles (Megatron-Core's own pattern: it creates ``*_gloo`` twins of its data-parallel groups). A
request with ``backend=None`` (or the device backend, "nccl" on GPUs) asks for a DEVICE group, which
moves device tensors; ``backend="gloo"`` asks for a HOST group, which moves small host metadata
(lengths, ids, plans, flags, pickled objects). When the device policy needs both
(``device_policy.policy().separate_host_groups``: CUDA, and the emulation tier, whose groups all
run on gloo but are tagged by the backend they were made with), every device group gets its host
twin, created right after it, and ``host_group(group)`` returns it; the twin of a group of every
rank is the host world group (``init_host_world``, called by ``runtime.initialize``). Megatron's
explicit gloo requests of a rank set hit that rank set's twin (one key), never a third group. On a
CPU run (everything gloo) the roles share one group: the same groups as without roles, and
``host_group(g)`` is ``g``.

Key: ``(sorted ranks, role, options)``, role "device" / "host" (separate host groups) or "shared";
host keys carry no options. Groups of different purposes but equal ranks (e.g. Megatron's tp and mp
groups when pp = 1) share one group too: every rank issues collectives on them in the same program
order, so sharing is safe; on NCCL it serialises what separate communicators could overlap (see
docs/layouts.md). Timeouts: every group gets the process's collective timeout
(``device_policy.collective_timeout()``, the run's ``runtime.collective_timeout_s``), whatever the
request asks (Megatron asks for its ``distributed_timeout_minutes``, 30 by default), so that a
stuck peer fails every collective after one configured time; it is not part of the key.

Order: torch requires every rank of the world to call ``new_group`` for every group, in the same
order, members or not. ``GroupCache.get`` records non-member results
(``GroupMember.NON_GROUP_MEMBER``) too, so the cache holds the same keys on every rank, and a
miss -- the only case that calls ``new_group`` (for a device group: the group, then its twin) --
happens at the same call on every rank, provided callers ask for groups in an order derived only
from the layout (``megatron_earl.parallel.state`` asks in the order of Megatron's
``initialize_model_parallel``, which depends only on the layout).

Batched p2p: NCCL requires the first ``batch_isend_irecv`` on a fresh communicator to involve all
its ranks. ``prepare_p2p(group)`` runs one small all-reduce over a device group before its first
batched p2p (device policies only; once per group, forgotten when the group is destroyed).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from megatron_earl import device_policy

GroupKey = tuple[tuple[int, ...], str, tuple[Any, ...] | None]
"""(sorted member ranks, role name, options key or None)."""

_NCCL_CONFIG_FIELDS = ("cga_cluster_size", "max_ctas", "min_ctas", "net_name")


class Role(str, Enum):
    """What a cached group moves."""

    DEVICE = "device"
    """Device tensors (NCCL on GPUs)."""
    HOST = "host"
    """Host metadata: small CPU tensors and pickled objects (gloo)."""
    SHARED = "shared"
    """Both: a CPU run, where every group is gloo."""


@dataclass
class CacheStats:
    """Counters of one ``GroupCache``."""

    created: int = 0
    """``new_group`` calls made (members and non-members alike; twins and host world included)."""
    hits: int = 0
    """Requests answered from the cache."""
    p2p_warmups: int = 0
    """All-reduces run by ``prepare_p2p`` (one per device group used for batched p2p)."""


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
    """Process groups by ``(ranks, role, options)``; created once, destroyed only by ``destroy``.

    ``separate_host``: whether device and host groups are distinct (None: ask
    ``device_policy.policy().separate_host_groups`` at each call; tests force it,
    ``forced_host_groups``).

    Which ranks call: ``get`` must be called by every rank of the world with the same arguments in
    the same order (a miss calls ``torch.distributed.new_group``, a collective over the world);
    ``init_host_world`` and ``destroy`` likewise.
    """

    def __init__(self, separate_host: bool | None = None) -> None:
        self.separate_host = separate_host
        self._groups: dict[GroupKey, Any] = {}
        self._created: list[Any] = []
        self._hosts: list[Any] = []
        self._host_world: Any = None
        self._p2p_ready: list[Any] = []
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._groups)

    def separate(self) -> bool:
        """Whether device groups have host twins (``separate_host``, else the device policy)."""
        if self.separate_host is not None:
            return self.separate_host
        return device_policy.policy().separate_host_groups

    def role(self, backend: str | None) -> Role:
        """The role a request with ``backend`` asks for: the host backend ("gloo") is HOST,
        anything else (None, "nccl") DEVICE; SHARED when the roles share groups."""
        if not self.separate():
            return Role.SHARED
        host = device_policy.policy().host_backend
        return Role.HOST if backend is not None and str(backend).lower() == host else Role.DEVICE

    def key(self, ranks: Iterable[int], backend: str | None = None, pg_options: Any = None):
        """The cache key of a request (module docstring: roles)."""
        members = tuple(sorted(int(r) for r in ranks))
        if len(set(members)) != len(members):
            raise ValueError(f"process group ranks {members} contain duplicates")
        role = self.role(backend)
        options = None if role is Role.HOST else options_key(pg_options)
        return (members, role.value, options)

    def get(
        self,
        ranks: Iterable[int],
        *,
        backend: str | None = None,
        pg_options: Any = None,
        timeout: datetime.timedelta | None = None,
        group_desc: str | None = None,
    ) -> Any:
        """The group of ``ranks`` (``GroupMember.NON_GROUP_MEMBER`` on ranks outside it). A new
        device group gets its host twin right away (when the roles are separate). ``timeout`` is
        accepted (Megatron passes one) and ignored: every group gets the process's collective
        timeout (module docstring).

        Every rank of the world calls it, in the same order (see the class docstring).
        """
        key = self.key(ranks, backend, pg_options)
        group = self._lookup(key)
        if group is not None:
            return group
        if key[1] == Role.HOST.value:
            return self._new(key, device_policy.policy().host_backend, None, group_desc)
        group = self._new(key, backend, pg_options, group_desc)
        twin = (key[0], Role.HOST.value, None)
        if key[1] == Role.DEVICE.value and twin not in self._groups:
            desc = f"{group_desc}_HOST" if group_desc else None
            self._new(twin, device_policy.policy().host_backend, None, desc)
        return group

    def init_host_world(self) -> None:
        """Create the host group of every rank (the world's twin) when the roles are separate
        and it does not exist yet; nothing on a CPU run. Every rank of the world calls it."""
        if not self.separate():
            return
        live = dist.distributed_c10d._world.pg_map
        if self._host_world is not None and self._host_world in live:
            return
        key = (tuple(range(dist.get_world_size())), Role.HOST.value, None)
        self._groups.pop(key, None)
        self._host_world = dist.new_group(
            ranks=list(key[0]),
            timeout=device_policy.collective_timeout(),
            backend=device_policy.policy().host_backend,
            group_desc="HOST_WORLD",
        )
        self.stats.created += 1
        self._groups[key] = self._host_world
        self._hosts.append(self._host_world)

    def host_group(self, group: Any = None) -> Any:
        """The host twin of device group ``group`` (None or the world group: the host world);
        ``group`` itself when it is a host group or the roles share groups. Local.

        Raises for a group the cache did not create (it has no twin)."""
        if not self.separate():
            return group
        if group is None or group is dist.GroupMember.WORLD:
            if self._host_world is None:
                raise RuntimeError(
                    "no host world group: runtime.initialize() creates it (or call "
                    "megatron_earl.parallel.groups.init_host_world() on every rank)"
                )
            return self._host_world
        if any(group is g for g in self._hosts):
            return group
        members = tuple(sorted(dist.get_process_group_ranks(group)))
        twin = self._groups.get((members, Role.HOST.value, None))
        if twin is None:
            raise RuntimeError(
                f"the process group of ranks {list(members)} has no host twin: it was not made "
                "by megatron_earl.parallel.groups (make it with group_cache().get(ranks))"
            )
        return twin

    def prepare_p2p(self, group: Any = None) -> None:
        """Before the first ``batch_isend_irecv`` on device group ``group`` (None: the world):
        one all-reduce of a one-element device tensor over it, so that the communicator's first
        operation involves all its ranks (NCCL's rule). Only when the roles are separate (NCCL,
        emulation); once per group until it is destroyed.

        Which ranks call: every rank of ``group``, before the first batched p2p on it."""
        if not self.separate():
            return
        if group is dist.GroupMember.WORLD:
            group = None
        if any(group is g for g in self._p2p_ready):
            return
        dist.all_reduce(torch.zeros(1, device=device_policy.device()), group=group)
        self._p2p_ready.append(group)
        self.stats.p2p_warmups += 1

    def member_groups(self) -> list[Any]:
        """The groups this rank belongs to, in creation order (host twins included; not the
        host world)."""
        return list(self._created)

    def keys(self) -> list[GroupKey]:
        """Every key held (the same list, in the same order, on every rank)."""
        return list(self._groups)

    def destroy(self) -> None:
        """Destroy exactly the groups this cache created for layouts (device groups and their
        twins) and forget them; the host world stays (it lives as long as the world).

        Every rank of the world calls it. Groups destroyed elsewhere already are skipped.
        """
        live = dist.distributed_c10d._world.pg_map
        for group in reversed(self._created):
            if group in live:
                dist.destroy_process_group(group)
        self._groups = {k: g for k, g in self._groups.items() if g is self._host_world}
        self._hosts = [g for g in self._hosts if g is self._host_world]
        self._p2p_ready = [g for g in self._p2p_ready if g is None]
        self._created.clear()

    def _lookup(self, key: GroupKey) -> Any:
        group = self._groups.get(key)
        if group is None:
            return None
        if self._is_member(key) and group not in dist.distributed_c10d._world.pg_map:
            raise RuntimeError(
                f"cached process group of ranks {list(key[0])} ({key[1]}) was destroyed "
                "outside the cache (megatron's destroy_model_parallel() destroys gloo "
                "groups); tear down with megatron_earl.parallel.state.destroy_layouts()"
            )
        self.stats.hits += 1
        return group

    def _new(
        self,
        key: GroupKey,
        backend: str | None,
        pg_options: Any,
        group_desc: str | None,
    ) -> Any:
        group = dist.new_group(
            ranks=list(key[0]),
            timeout=device_policy.collective_timeout(),
            backend=backend,
            pg_options=pg_options,
            group_desc=group_desc,
        )
        self.stats.created += 1
        self._groups[key] = group
        if self._is_member(key):
            self._created.append(group)
            if key[1] == Role.HOST.value:
                self._hosts.append(group)
        return group

    @staticmethod
    def _is_member(key: GroupKey) -> bool:
        return dist.get_rank() in key[0]


_CACHE = GroupCache()


def group_cache() -> GroupCache:
    """This process's cache (one per process; ``megatron_earl.parallel.state`` uses it)."""
    return _CACHE


def host_group(group: Any = None) -> Any:
    """The host (gloo) group for metadata about ``group``'s collective (None: the world's).

    Every metadata collective of the project goes through it: small CPU tensors and pickled
    objects (lengths, ids, plans, flags, metrics). Local (no communication)."""
    return _CACHE.host_group(group)


def prepare_p2p(group: Any = None) -> None:
    """``GroupCache.prepare_p2p`` on this process's cache. Which ranks call: every rank of
    ``group`` (None: the world), before the first batched p2p on it."""
    _CACHE.prepare_p2p(group)


def init_host_world() -> None:
    """Create the host world group on a device policy (``runtime.initialize`` calls it).
    Every rank of the world calls it."""
    _CACHE.init_host_world()


@contextlib.contextmanager
def forced_host_groups(separate: bool = True) -> Iterator[GroupCache]:
    """Tests: run this process's cache with separate host groups (or shared ones) whatever the
    device policy, e.g. twins on a CPU (gloo) world. Creates the host world on entry when needed
    and destroys it on exit when it created it.

    Every rank of the world enters and leaves it, with no layout alive (``destroy_layouts()``
    before entering and before leaving)."""
    cache = _CACHE
    if cache.member_groups():
        raise RuntimeError(
            "forced_host_groups() needs an empty group cache: call "
            "megatron_earl.parallel.state.destroy_layouts() first"
        )
    saved, had_world = cache.separate_host, cache._host_world
    cache.separate_host = separate
    cache.init_host_world()
    try:
        yield cache
    finally:
        leftover = bool(cache.member_groups())
        made = cache._host_world if cache._host_world is not had_world else None
        cache.separate_host = saved
        if made is not None:
            cache._groups = {k: g for k, g in cache._groups.items() if g is not made}
            cache._hosts = [g for g in cache._hosts if g is not made]
            cache._host_world = had_world
            if made in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(made)
    if leftover:
        raise RuntimeError("leave forced_host_groups() after destroy_layouts() (groups left)")
