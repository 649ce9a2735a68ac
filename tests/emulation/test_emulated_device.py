"""The emulation tier's own rules: what fails as it would on CUDA/NCCL, what stays allowed.

Every body runs in fresh processes with ``MEGATRON_EARL_EMULATE_DEVICE=1`` (the emulated device
changes process-wide state, so never in the pytest process).
"""

from __future__ import annotations

import pytest
import torch

from megatron_earl.testing.distributed import DistributedTestError, free_port, run_distributed
from tests.emulation.common import EMULATED


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as err:  # the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "ok"


def _mixing_rules() -> dict[str, str]:
    from megatron_earl import runtime

    dev = runtime.device()
    x = torch.ones(3, device=dev)
    host = torch.ones(3)
    lin = torch.nn.Linear(3, 2).to(dev)
    out = {
        "device": str(dev),
        "policy": runtime.describe_policy(),
        "factory": x.device.type,
        "mixed": _outcome(lambda: x + host),
        "mixed_module": _outcome(lambda: lin(torch.ones(4, 3))),
        "host_scalar": _outcome(lambda: x * torch.tensor(2.0)),
        "host_scalar_fill": _outcome(lambda: x.masked_fill(x > 0, torch.tensor(0.5))),
        "host_scalar_stack": _outcome(lambda: torch.stack([x.sum(), torch.tensor(2.0)])),
        "host_scalar_embedding": _outcome(
            lambda: torch.nn.functional.embedding(torch.tensor(1), x.view(3, 1))
        ),
        "host_scalar_index_select": _outcome(lambda: x.index_select(0, torch.tensor(1))),
        "host_index": _outcome(lambda: x[torch.tensor([0, 2])]),
        "device_index_into_host": _outcome(lambda: host[torch.tensor([0, 2], device=dev)]),
        "copies": _outcome(lambda: (x.cpu() + host, host.to(dev) + x)),
        "numpy": _outcome(lambda: x.numpy()),
        "tolist": str(x.tolist()),
        "from_device_scalars": str(torch.tensor([x.sum(), x.sum()]).device),
        "tensor_on_device": torch.tensor([1.0, 2.0], device=dev).device.type,
    }
    loss = lin(torch.ones(4, 3, device=dev)).sum()
    loss.backward()
    out["grad"] = lin.weight.grad.device.type
    with torch.inference_mode():
        buf = torch.zeros(4, 3, device=dev)
        buf[1:2] = buf[2:3] + 1  # views and in-place writes in inference mode, as the engine does
    out["inference_views"] = str(buf.sum().item())
    return out


def test_host_device_mixing_fails_as_on_cuda():
    (out,) = run_distributed(_mixing_rules, 1, timeout_s=120, env=EMULATED)
    assert out["device"] == "emu:0" and out["factory"] == "emu"
    assert "emulated device" in out["policy"] and "host groups gloo" in out["policy"]
    # A host tensor with a device tensor: the op, the host tensor and this file's line are named.
    assert out["mixed"].startswith("HostDeviceMixError: aten::add.Tensor got a host tensor")
    assert "(3,) (torch.float32)" in out["mixed"] and "test_emulated_device.py" in out["mixed"]
    assert "aten::addmm" in out["mixed_module"] and "(4, 3)" in out["mixed_module"]
    assert "host tensor" in out["device_index_into_host"]
    # A CPU scalar outside a pointwise op or a fill value: CUDA refuses it ("Expected all
    # tensors to be on the same device"), so does the emulated device.
    for op, name in (("stack", "aten::stack"), ("embedding", "aten::embedding"),
                     ("index_select", "aten::index_select")):  # fmt: skip
        assert out[f"host_scalar_{op}"].startswith(f"HostDeviceMixError: {name}"), out
        assert "host tensor of shape ()" in out[f"host_scalar_{op}"], out[f"host_scalar_{op}"]
    # What CUDA accepts stays accepted.
    for allowed in ("host_scalar", "host_scalar_fill", "host_index", "copies"):
        assert out[allowed] == "ok", (allowed, out[allowed])
    assert out["numpy"].startswith("TypeError: can't convert emu:0 device type tensor to numpy")
    assert out["tolist"] == "[1.0, 1.0, 1.0]"
    assert out["from_device_scalars"] == "cpu" and out["tensor_on_device"] == "emu"
    assert out["grad"] == "emu" and out["inference_views"] == "3.0"


def _collective_roles() -> dict[str, str]:
    import torch.distributed as dist

    from megatron_earl import runtime
    from megatron_earl.parallel.groups import host_group
    from megatron_earl.rollout.weights.group import broadcast_bucket, join_weight_update_group

    dev = runtime.device()
    rank = dist.get_rank()
    peer = 1 - rank
    world = dist.group.WORLD

    def p2p():
        recv = torch.empty(2, device=dev)
        ops = [
            dist.P2POp(dist.isend, torch.full((2,), float(dist.get_rank()), device=dev), peer),
            dist.P2POp(dist.irecv, recv, peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert recv.tolist() == [float(peer)] * 2

    def device_all_reduce():
        t = torch.ones(2, device=dev)
        dist.all_reduce(t)
        assert t.device == dev and t.tolist() == [2.0, 2.0]

    def host_all_reduce():
        t = torch.ones(2)
        dist.all_reduce(t, group=host_group())
        assert t.tolist() == [2.0, 2.0]

    def gather_objects():
        box = [None, None]
        dist.all_gather_object(box, {"rank": dist.get_rank()})
        assert [b["rank"] for b in box] == [0, 1]

    def method_on_device_group():  # what dist.all_reduce does, called on the group itself
        t = torch.ones(2, device=dev)
        world.allreduce([t]).wait()
        assert t.device == dev and t.tolist() == [2.0, 2.0]

    def broadcast_options():
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return opts

    def reduce_options(op):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return opts

    def weight_update_group():  # the SGLang weight-update group (a gloo group of its own)
        box = [free_port() if rank == 0 else None]
        dist.broadcast_object_list(box, group=host_group())
        return join_weight_update_group("127.0.0.1", box[0], rank, 2, "wug", "gloo", 60)

    group = weight_update_group()
    ints = torch.tensor([6, 3], device=dev)
    other = f"emu:{peer}"
    out = {
        "device_on_device_group": _outcome(device_all_reduce),
        "host_on_host_group": _outcome(host_all_reduce),
        "host_on_device_group": _outcome(lambda: dist.all_reduce(torch.ones(2))),
        "device_on_host_group": _outcome(
            lambda: dist.all_reduce(torch.ones(2, device=dev), group=host_group())
        ),
        "objects": _outcome(gather_objects),
        "p2p": _outcome(p2p),
        "host_p2p": _outcome(
            lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), peer)])
        ),
        # Collectives called on the ProcessGroup object, as SGLang and weights/group.py do
        "method_device_on_device_group": _outcome(method_on_device_group),
        "method_host_on_device_group": _outcome(
            lambda: world.broadcast([torch.ones(2)], broadcast_options()).wait()
        ),
        "method_device_on_host_group": _outcome(
            lambda: host_group().allreduce([torch.ones(2, device=dev)]).wait()
        ),
        "weight_group_host": _outcome(lambda: broadcast_bucket(group, [("w", torch.ones(2))])),
        "weight_group_device": _outcome(
            lambda: broadcast_bucket(group, [("w", torch.ones(2, device=dev))])
        ),
        # Reduce ops NCCL has not: refused on device groups, allowed on host (gloo) groups
        "band_device": _outcome(lambda: dist.all_reduce(ints, op=dist.ReduceOp.BAND)),
        "bor_method_device": _outcome(
            lambda: world.allreduce([ints], reduce_options(dist.ReduceOp.BOR)).wait()
        ),
        "bxor_reduce_scatter_device": _outcome(
            lambda: dist.reduce_scatter_tensor(
                torch.zeros(1, dtype=ints.dtype, device=dev), ints, op=dist.ReduceOp.BXOR
            )
        ),
        "band_host": _outcome(
            lambda: dist.all_reduce(ints.cpu(), op=dist.ReduceOp.BAND, group=host_group())
        ),
        "max_device": _outcome(lambda: dist.all_reduce(ints.clone(), op=dist.ReduceOp.MAX)),
        # The peer's device index: refused in a collective as NCCL refuses it
        "other_index_on_device_group": _outcome(
            lambda: dist.all_reduce(torch.ones(2, device=other))
        ),
    }
    group.shutdown()
    return out


@pytest.fixture(scope="module")
def collective_outcomes() -> list[dict[str, str]]:
    return run_distributed(_collective_roles, 2, timeout_s=120, env=EMULATED)


def test_collectives_check_the_group_role(collective_outcomes):
    for out in collective_outcomes:
        for ok in ("device_on_device_group", "host_on_host_group", "objects", "p2p"):
            assert out[ok] == "ok", (ok, out[ok])
        assert "all_reduce got a host tensor of shape (2,)" in out["host_on_device_group"]
        assert "on a device group (NCCL" in out["host_on_device_group"]
        assert "test_emulated_device.py" in out["host_on_device_group"]
        assert "device tensor of shape (2,) on a host (gloo) group" in out["device_on_host_group"]
        assert "batch_isend_irecv got a host tensor" in out["host_p2p"]


def test_collectives_on_process_group_objects_are_guarded(collective_outcomes):
    """``group.allreduce([t])`` / ``group.broadcast(...)`` (SGLang's weight-update group,
    ``rollout/weights/group.py``) follow the rules of the ``torch.distributed`` functions."""
    for out in collective_outcomes:
        assert out["method_device_on_device_group"] == "ok", out["method_device_on_device_group"]
        assert out["weight_group_host"] == "ok", out["weight_group_host"]
        host_on_device = out["method_host_on_device_group"]
        expected = "HostDeviceMixError: ProcessGroup.broadcast got a host tensor of shape (2,)"
        assert host_on_device.startswith(expected), host_on_device
        assert "on a device group (NCCL" in host_on_device
        assert "test_emulated_device.py" in host_on_device
        device_on_host = out["method_device_on_host_group"]
        expected = "HostDeviceMixError: ProcessGroup.allreduce got a device tensor of shape (2,)"
        assert device_on_host.startswith(expected), device_on_host
        assert "on a host (gloo) group" in device_on_host
        weight_group = out["weight_group_device"]  # the trainer's side of the gloo group
        expected = "HostDeviceMixError: ProcessGroupGloo.broadcast got a device tensor"
        assert weight_group.startswith(expected), weight_group
        assert "on a host (gloo) group" in weight_group and "weights/group.py" in weight_group


def test_reduce_ops_nccl_lacks_are_refused_on_device_groups(collective_outcomes):
    for out in collective_outcomes:
        refused = {"band_device": "BAND", "bor_method_device": "BOR",
                   "bxor_reduce_scatter_device": "BXOR"}  # fmt: skip
        for key, op in refused.items():
            assert out[key].startswith(f"ValueError: Cannot use ReduceOp.{op} with NCCL"), out[key]
            assert "test_emulated_device.py" in out[key]
        assert out["band_host"] == "ok" and out["max_device"] == "ok"


def _device_indices() -> dict[str, str]:
    import torch.distributed as dist

    from megatron_earl import runtime

    dev = runtime.device()
    theirs = torch.ones(3, device=f"emu:{1 - dist.get_rank()}")  # the peer rank's device
    x = torch.ones(3, device=dev)
    lin = torch.nn.Linear(3, 2).to(dev)

    def backward():
        lin(x.view(1, 3)).sum().backward()
        assert lin.weight.grad.device == dev

    return {
        "device": str(dev),
        "current": str(torch.emu.current_device()),
        "unindexed_factory": str(torch.ones(1, device="emu").device),
        "theirs": str(theirs.device),
        "mixed": _outcome(lambda: x + theirs),
        "mixed_scalar": _outcome(lambda: x * theirs.sum()),
        "mixed_module": _outcome(lambda: lin(theirs.view(1, 3))),
        "moved_first": _outcome(lambda: x + theirs.to(dev)),
        "copy_across": _outcome(lambda: x.clone().copy_(theirs)),
        "backward": _outcome(backward),
    }


def test_each_rank_has_its_own_device_index(collective_outcomes):
    """Rank r computes on ``emu:r`` (``cuda:LOCAL_RANK`` on GPUs): a tensor of another index in
    an op fails as on CUDA; moving it first, or copying across, is allowed."""
    results = run_distributed(_device_indices, 2, timeout_s=120, env=EMULATED)
    for rank, out in enumerate(results):
        mine, theirs = f"emu:{rank}", f"emu:{1 - rank}"
        assert out["device"] == mine and out["current"] == str(rank), out
        assert out["unindexed_factory"] == mine, out
        assert out["theirs"] == theirs
        ops = {"mixed": "aten::add.Tensor", "mixed_scalar": "aten::mul.Tensor",
               "mixed_module": "aten::addmm"}  # fmt: skip
        for key, op in ops.items():
            expected = f"HostDeviceMixError: {op} got tensors on {mine} and {theirs}"
            assert out[key].startswith(expected), out[key]
            assert "Expected all tensors to be on the same device" in out[key]
            assert "test_emulated_device.py" in out[key]
        for ok in ("moved_first", "copy_across", "backward"):
            assert out[ok] == "ok", (ok, out[ok])
    for rank, out in enumerate(collective_outcomes):  # NCCL: a communicator's own device only
        wrong = out["other_index_on_device_group"]
        expected = "HostDeviceMixError: torch.distributed.all_reduce got a device tensor of shape"
        assert wrong.startswith(f"{expected} (2,) on emu:{1 - rank}"), wrong
        assert f"communicates on emu:{rank}" in wrong


def _pending_copies() -> dict[str, str]:
    from megatron_earl import runtime

    dev = runtime.device()
    x = torch.arange(4.0, device=dev)
    out = {}
    early = x.to("cpu", non_blocking=True)
    out["metadata_before_sync"] = f"{tuple(early.shape)} {early.dtype} {early.device}"
    out["read_before_sync"] = _outcome(lambda: early.sum())
    out["tolist_before_sync"] = _outcome(lambda: early.tolist())
    torch.emu.synchronize()
    out["after_sync"] = _outcome(lambda: early.tolist())
    out["type_after_sync"] = type(early).__name__
    out["values_after_sync"] = str(early.tolist())

    buf = torch.zeros(4)  # a staging buffer written by a non-blocking copy
    buf.copy_(x, non_blocking=True)
    out["buffer_before_event"] = _outcome(lambda: buf + 1)
    event = torch.emu.Event()
    event.record()
    event.synchronize()
    out["buffer_after_event"] = str(buf.tolist())

    event = torch.emu.Event()
    event.record()  # before the copy: waiting on it does not cover the copy
    late = x.to("cpu", non_blocking=True)
    event.synchronize()
    out["event_before_copy"] = _outcome(lambda: late.sum())
    torch.emu.current_stream().synchronize()
    out["after_stream_sync"] = _outcome(lambda: late.sum())

    implicit = x.to("cpu", non_blocking=True)
    x.sum().item()  # a blocking device -> host read waits for the stream, as .item() on CUDA
    out["after_item"] = _outcome(lambda: implicit.sum())
    out["blocking_copy"] = _outcome(lambda: x.cpu().sum())
    out["to_host"] = _outcome(lambda: runtime.to_host(x).sum())
    return out


def test_non_blocking_copy_read_before_a_sync_fails():
    (out,) = run_distributed(_pending_copies, 1, timeout_s=120, env=EMULATED)
    assert out["metadata_before_sync"] == "(4,) torch.float32 cpu"  # metadata is no read
    unsynced = (
        "read_before_sync",
        "tolist_before_sync",
        "buffer_before_event",
        "event_before_copy",
    )
    for key in unsynced:
        assert out[key].startswith("UnsyncedReadError: a host tensor of shape (4,) "), out[key]
        assert "non-blocking device -> host copy" in out[key]
        assert "test_emulated_device.py" in out[key]
    assert "read by sum()" in out["read_before_sync"]
    assert "read by tolist()" in out["tolist_before_sync"]
    for key in ("after_sync", "after_stream_sync", "after_item", "blocking_copy", "to_host"):
        assert out[key] == "ok", (key, out[key])
    assert out["type_after_sync"] == "Tensor"  # a plain host tensor again
    assert out["values_after_sync"] == out["buffer_after_event"] == "[0.0, 1.0, 2.0, 3.0]"


def _never_reached() -> None:
    raise AssertionError("initialize should have refused this rank")


def test_more_ranks_than_devices_is_refused_before_any_group():
    with pytest.raises(DistributedTestError) as err:
        run_distributed(
            _never_reached,
            2,
            timeout_s=60,
            env={**EMULATED, "MEGATRON_EARL_EMULATED_DEVICES": "1"},
        )
    message = str(err.value)
    assert "LOCAL_RANK=1 needs emulated device 1, but this node has 1 emulated device(s)" in message
    assert "valid LOCAL_RANK: 0..0" in message
