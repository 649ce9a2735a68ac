"""The weight-update process group of SGLang's distributed protocol, on both of its sides.

    # trainer (rank 0; hosts the rendezvous store) and, concurrently, each engine TP rank
    # (rank = rank_offset + tp_rank, what SGLang's /init_weights_update_group does):
    group = join_weight_update_group("10.0.0.1", 29600, rank, world_size, "weight_update_group",
                                     "gloo", timeout_s=300)
    broadcast_bucket(group, bucket, flattened=False)      # trainer: send; engines: receive_bucket

The group is a standalone process group (its own TCP store, under the prefixes SGLang's
``init_custom_process_group`` gives its keys: ``sglang_group_store``): it never touches the
default group of either side, so a trainer's torchrun world and a server's own world stay as
they are. gloo on
CPU (``megatron-earl serve``, CI), NCCL between GPUs (SGLang; the tensors must then be on the
device). A peer that never joins ends in a ``TimeoutError`` naming the rendezvous after
``timeout_s``, not in a hang.

Wire format per bucket (SGLang's ``update_weights_from_distributed``): ``load_format`` None ->
one broadcast per tensor, in the order of ``names``; ``"flattened_bucket"`` -> one broadcast of
the bucket's bytes (uint8), tensors back to back in that order, each at an offset its dtype's
size divides (SGLang's ``FlattenedTensorBucket`` refuses others; ``flattened_sizes``).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_earl.config.vocab import DistributedLoadFormat

NamedTensor = tuple[str, torch.Tensor]
FLATTENED = DistributedLoadFormat.FLATTENED_BUCKET
LOAD_FORMATS = (None, FLATTENED)
"""``load_format`` values of ``update_weights_from_distributed`` both sides implement."""


def join_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    store: dist.TCPStore | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host the store of) the group. Blocks until every rank joined, or raises
    ``TimeoutError`` after ``timeout_s``. Every rank of the group calls it, concurrently.
    ``store``: rank 0's store, already bound (``host_group_store``) at ``master_port``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if store is not None and (rank != 0 or store.port != master_port):
        raise ValueError(
            f"a store bound in advance is rank 0's, at its own port {store.port}; got rank "
            f"{rank}, master_port {master_port}"
        )
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} is not one of 'gloo', 'nccl'")
    timeout = datetime.timedelta(seconds=timeout_s)
    where = (
        f"weight-update group {group_name!r} at {master_address}:{master_port} "
        f"(rank {rank} of {world_size})"
    )
    try:
        store = store or dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        store = sglang_group_store(store, group_name, backend)
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    except (RuntimeError, dist.DistError) as err:
        # Rank 0 hosts the store: dropping it now (not when the error's traceback is collected)
        # ends the other ranks' waits at once. SGLang's own wait has no timeout of its own (30
        # min): it blocks its scheduler until the store goes away.
        store = None
        message = str(err)
    timed_out = "timeout" in message.lower() or "timed out" in message.lower()
    if timed_out:
        raise TimeoutError(f"{where}: not every rank joined within {timeout_s:g} s ({message})")
    raise RuntimeError(f"{where}: cannot join: {message}")


def host_group_store(address: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store of a group on a port the OS picks at bind time (``.port``): the port the
    engines are told is already held, where a port picked free and bound later can be taken
    by another process in between."""
    return dist.TCPStore(
        address,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def group_device(group: Any) -> torch.device:
    """Where ``group`` moves tensors: this process's current CUDA device for an NCCL group
    (NCCL cannot read host memory), the host for gloo."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is not None and isinstance(group, nccl):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


GROUP_DEVICE = {"gloo": "cpu", "nccl": "cuda"}
"""The device torch's ``_new_process_group_helper`` registers each backend for (its store
prefix)."""


def sglang_group_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    """The store the group's backend talks through, with the keys SGLang's side uses.

    SGLang's ``init_custom_process_group`` wraps the rendezvous store in
    ``PrefixStore(group_name)`` and hands it to torch's ``_new_process_group_helper``, which
    wraps it again in ``PrefixStore(f"{group_name}/")`` and then in ``PrefixStore(f"{device}/")``
    for the backend's device (gloo: cpu, NCCL: cuda). A backend's keys are therefore
    ``<group>/<group>//<device>//<key>``; a sender on ``PrefixStore(group_name)`` alone never
    meets SGLang's ranks. Both sides of this project (trainer and ``serve``) build the same.
    """
    store = dist.PrefixStore(group_name, store)
    store = dist.PrefixStore(f"{group_name}/", store)
    return dist.PrefixStore(f"{GROUP_DEVICE[backend]}/", store)


def flattened_sizes(
    names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[int]:
    """Byte sizes of a flattened bucket's tensors; ``ValueError`` naming the first tensor whose
    offset its dtype's size does not divide (e.g. float32 after an odd count of bfloat16)."""
    sizes, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if offset % dtype.itemsize:
            raise ValueError(
                f"flattened bucket: {name} ({str(dtype).removeprefix('torch.')}) would start at "
                f"byte {offset}, not a multiple of {dtype.itemsize}; order or split the bucket"
            )
        sizes.append(torch.Size(shape).numel() * dtype.itemsize)
        offset += sizes[-1]
    return sizes


def flatten_bucket(bucket: Sequence[NamedTensor]) -> torch.Tensor:
    """The bucket's bytes (uint8), tensors back to back in order (``flattened_sizes`` checks
    their alignment). SGLang's ``FlattenedTensorBucket`` layout, also of the ``flattened_bucket``
    payload of ``update_weights_from_tensor`` (``tensor_payload``)."""
    flattened_sizes([n for n, _ in bucket], [t.dtype for _, t in bucket],
                    [t.shape for _, t in bucket])  # fmt: skip
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def unflatten_bucket(
    flat: torch.Tensor,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> list[NamedTensor]:
    """Views of ``flat`` (uint8, from ``flatten_bucket``) as the named tensors; ``ValueError``
    when its size is not the tensors' total."""
    sizes = flattened_sizes(names, dtypes, shapes)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(
            f"flattened bucket: a 1-D uint8 tensor of {sum(sizes)} bytes is needed for "
            f"{len(names)} tensors, got {str(flat.dtype).removeprefix('torch.')} of shape "
            f"{tuple(flat.shape)}"
        )
    out, offset = [], 0
    for name, dtype, shape, size in zip(names, dtypes, shapes, sizes, strict=True):
        out.append((name, flat[offset : offset + size].view(dtype).reshape(tuple(shape))))
        offset += size
    return out


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def broadcast_bucket(
    group: dist.ProcessGroup, bucket: Sequence[NamedTensor], load_format: str | None = None
) -> None:
    """Send one bucket from rank 0 (the trainer). Call it while the engines handle the
    bucket's ``update_weights_from_distributed`` request (they receive it)."""
    if load_format == FLATTENED:
        _broadcast(group, flatten_bucket(bucket))
        return
    for _, tensor in bucket:
        _broadcast(group, tensor.detach().contiguous())


def receive_bucket(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    load_format: str | None = None,
    device: torch.device | str | None = None,
) -> list[NamedTensor]:
    """Receive one bucket on an engine rank (inverse of ``broadcast_bucket``), into ``device``:
    by default the group's (``group_device``)."""
    device = group_device(group) if device is None else device
    if load_format == FLATTENED:
        sizes = flattened_sizes(names, dtypes, shapes)
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        _broadcast(group, flat)
        return unflatten_bucket(flat, names, dtypes, shapes)
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
        _broadcast(group, tensor)
        out.append((name, tensor))
    return out
