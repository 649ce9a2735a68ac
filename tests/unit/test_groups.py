"""The process-group cache's roles without processes: keys, host twins, the host world, teardown
and the p2p warm-up bookkeeping, with ``torch.distributed``'s group calls replaced by fakes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_earl.parallel import groups
from megatron_earl.parallel.groups import GroupCache, Role

WORLD = 4
NCCL_OPTIONS = SimpleNamespace(
    is_high_priority_stream=True,
    config=SimpleNamespace(cga_cluster_size=4, max_ctas=None, min_ctas=None, net_name=None),
)


class FakeGroup:
    def __init__(self, ranks, backend):
        self.ranks, self.backend = tuple(ranks), backend

    def __repr__(self) -> str:
        return f"FakeGroup({self.ranks}, {self.backend})"


@pytest.fixture
def fake_dist(monkeypatch):
    """Rank 0 of a world of 4; records ``new_group`` / ``destroy_process_group`` /
    ``all_reduce`` calls."""
    world = SimpleNamespace(pg_map={}, default_pg=None)
    log = SimpleNamespace(new=[], destroyed=[], all_reduce=[])

    def new_group(ranks, timeout=None, backend=None, pg_options=None, group_desc=None):
        log.new.append((tuple(ranks), backend, pg_options))
        if 0 not in ranks:
            return dist.GroupMember.NON_GROUP_MEMBER
        group = FakeGroup(ranks, backend)
        world.pg_map[group] = backend
        return group

    def destroy(group):
        log.destroyed.append(group)
        del world.pg_map[group]

    monkeypatch.setattr(dist.distributed_c10d, "_world", world)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: list(group.ranks))
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: log.all_reduce.append(group))
    return log


def test_keys_by_role_when_host_groups_are_separate():
    cache = GroupCache(separate_host=True)
    assert cache.key([1, 0]) == ((0, 1), "device", None)
    assert cache.key([0, 1], backend="nccl") == ((0, 1), "device", None)
    assert cache.key([0, 1], backend="gloo") == ((0, 1), "host", None)
    assert cache.key([0, 1], backend="GLOO") == ((0, 1), "host", None)
    device = cache.key([0, 1], pg_options=NCCL_OPTIONS)
    assert device == ((0, 1), "device", ("nccl", True, 4, None, None, None))
    # a host group carries no options: Megatron's gloo request hits the one twin
    assert cache.key([0, 1], backend="gloo", pg_options=NCCL_OPTIONS) == ((0, 1), "host", None)
    assert cache.role(None) is Role.DEVICE and cache.role("gloo") is Role.HOST


def test_keys_share_one_role_on_a_cpu_run():
    cache = GroupCache(separate_host=False)
    assert cache.key([1, 0]) == cache.key([0, 1], backend="gloo") == ((0, 1), "shared", None)
    assert cache.key([0, 1], pg_options=NCCL_OPTIONS)[2] is not None
    # unforced: the device policy decides (CPU here: shared)
    assert GroupCache().role("gloo") is Role.SHARED and not GroupCache().separate()


def test_bad_requests_name_the_value():
    with pytest.raises(ValueError, match=r"\(0, 0, 1\) contain duplicates"):
        GroupCache(separate_host=True).key([0, 1, 0])
    with pytest.raises(TypeError, match="options of type dict"):
        GroupCache(separate_host=True).key([0, 1], pg_options={"x": 1})


def test_device_group_gets_its_twin_right_after_it(fake_dist):
    cache = GroupCache(separate_host=True)
    cache.init_host_world()
    assert fake_dist.new == [((0, 1, 2, 3), "gloo", None)]
    tp = cache.get([0, 1], pg_options=NCCL_OPTIONS)
    assert fake_dist.new[1:] == [((0, 1), None, NCCL_OPTIONS), ((0, 1), "gloo", None)]
    twin = cache.host_group(tp)
    assert twin is not tp and twin.ranks == (0, 1) and twin.backend == "gloo"
    # Megatron's explicit gloo request, and the same ranks with other options: no third group
    assert cache.get([0, 1], backend="gloo") is twin
    other = cache.get([0, 1])
    assert other is not tp and cache.host_group(other) is twin
    assert len(fake_dist.new) == 4 and cache.stats.created == 4
    # non-members hold the keys too (every rank creates every group, in the same order)
    assert cache.get([2, 3]) is dist.GroupMember.NON_GROUP_MEMBER
    assert fake_dist.new[4:] == [((2, 3), None, None), ((2, 3), "gloo", None)]
    assert ((2, 3), "host", None) in cache.keys()
    # the twin of a group of every rank is the host world
    everyone = cache.get(range(WORLD))
    assert cache.host_group(everyone) is cache.host_group(None) is cache.host_group()
    assert fake_dist.new[-1] == ((0, 1, 2, 3), None, None)
    # a host group asked for first: its device group later gets no second twin
    host = cache.get([0, 2], backend="gloo")
    device = cache.get([0, 2])
    assert cache.host_group(device) is host and cache.host_group(host) is host
    assert fake_dist.new[-2:] == [((0, 2), "gloo", None), ((0, 2), None, None)]


def test_host_group_refuses_unknown_groups_and_a_missing_host_world(fake_dist):
    cache = GroupCache(separate_host=True)
    with pytest.raises(RuntimeError, match=r"no host world group: runtime\.initialize"):
        cache.host_group(None)
    with pytest.raises(RuntimeError, match=r"ranks \[0, 3\] has no host twin"):
        cache.host_group(FakeGroup([3, 0], None))


def test_shared_roles_create_one_group_and_host_group_is_identity(fake_dist):
    cache = GroupCache(separate_host=False)
    cache.init_host_world()
    group = cache.get([0, 1])
    assert cache.get([0, 1], backend="gloo") is group
    assert fake_dist.new == [((0, 1), None, None)]
    assert cache.host_group(group) is group and cache.host_group(None) is None


def test_destroy_tears_down_twins_and_keeps_the_host_world(fake_dist):
    cache = GroupCache(separate_host=True)
    cache.init_host_world()
    world = cache.host_group()
    a, b = cache.get([0, 1]), cache.get([0])
    twins = [cache.host_group(a), cache.host_group(b)]
    cache.destroy()
    assert fake_dist.destroyed == [twins[1], b, twins[0], a]  # reverse creation order
    assert cache.keys() == [((0, 1, 2, 3), "host", None)] and cache.host_group() is world
    assert not cache.member_groups()
    again = cache.get([0, 1])
    assert again is not a and cache.host_group(again) is not twins[0]
    cache.init_host_world()  # alive: nothing new
    assert cache.host_group() is world


def test_prepare_p2p_runs_once_per_device_group(fake_dist):
    cache = GroupCache(separate_host=True)
    cache.init_host_world()
    group = cache.get([0, 1])
    for _ in range(3):
        cache.prepare_p2p(None)
        cache.prepare_p2p(dist.GroupMember.WORLD)
        cache.prepare_p2p(group)
    assert fake_dist.all_reduce == [None, group] and cache.stats.p2p_warmups == 2
    cache.destroy()  # a destroyed group's communicator is gone; the world's stays warm
    cache.prepare_p2p(None)
    fresh = cache.get([0, 1])
    cache.prepare_p2p(fresh)
    assert fake_dist.all_reduce == [None, group, fresh] and fresh is not group


def test_prepare_p2p_does_nothing_on_a_cpu_run(fake_dist):
    cache = GroupCache(separate_host=False)
    cache.prepare_p2p(None)
    cache.prepare_p2p(cache.get([0, 1]))
    assert fake_dist.all_reduce == [] and cache.stats.p2p_warmups == 0


def test_forced_host_groups_needs_an_empty_cache(fake_dist, monkeypatch):
    cache = GroupCache()
    monkeypatch.setattr(groups, "_CACHE", cache)
    with groups.forced_host_groups() as forced:
        assert forced is cache and cache.separate()
        world = groups.host_group()
        assert world.ranks == (0, 1, 2, 3)
    assert fake_dist.destroyed == [world] and not cache.separate() and groups.host_group() is None
    cache.get([0, 1])
    with pytest.raises(RuntimeError, match="destroy_layouts"):
        with groups.forced_host_groups():
            pass
    cache.destroy()
    with pytest.raises(RuntimeError, match="after destroy_layouts"):
        with groups.forced_host_groups():
            cache.get([0, 1])
