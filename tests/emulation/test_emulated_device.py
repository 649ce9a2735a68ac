"""The emulation tier's own rules: what fails as it would on CUDA/NCCL, what stays allowed.

Every body runs in fresh processes with ``MEGATRON_EARL_EMULATE_DEVICE=1`` (the emulated device
changes process-wide state, so never in the pytest process).
"""

from __future__ import annotations

import pytest
import torch

from megatron_earl.testing.distributed import DistributedTestError, run_distributed
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

    dev = runtime.device()
    peer = 1 - dist.get_rank()

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
        assert t.device.type == "emu" and t.tolist() == [2.0, 2.0]

    def host_all_reduce():
        t = torch.ones(2)
        dist.all_reduce(t, group=host_group())
        assert t.tolist() == [2.0, 2.0]

    def gather_objects():
        box = [None, None]
        dist.all_gather_object(box, {"rank": dist.get_rank()})
        assert [b["rank"] for b in box] == [0, 1]

    return {
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
    }


def test_collectives_check_the_group_role():
    results = run_distributed(_collective_roles, 2, timeout_s=120, env=EMULATED)
    for out in results:
        for ok in ("device_on_device_group", "host_on_host_group", "objects", "p2p"):
            assert out[ok] == "ok", (ok, out[ok])
        assert "all_reduce got a host tensor of shape (2,)" in out["host_on_device_group"]
        assert "on a device group (NCCL" in out["host_on_device_group"]
        assert "test_emulated_device.py" in out["host_on_device_group"]
        assert "device tensor of shape (2,) on a host (gloo) group" in out["device_on_host_group"]
        assert "batch_isend_irecv got a host tensor" in out["host_p2p"]


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
