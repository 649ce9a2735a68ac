"""Shard geometry of a Megatron model, read from its own ``sharded_state_dict()``.

Every parameter of a rank is described as one or more ``ShardPiece``s: a region (start/stop per
dimension) of a *global* tensor named by its checkpoint key, and a view of the local parameter that
holds exactly that region. This is what ``dist_checkpointing`` uses to reshard on load, so it covers
grouped QKV, TP-split gated ``linear_fc1`` (two pieces: gate and up), layer stacking across pipeline
stages (a prepended layer axis) and tied embeddings (two local parameters, one global key) without a
per-name table.

Mixture-of-experts layers (docs/resharding.md "Experts") need nothing of their own either:
megatron-core's ``SequentialMLP`` maps local expert k of expert-parallel rank r to global expert
``r * num_local_experts + k`` and names every expert weight by ONE stacked key per layer kind,
``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of global shape
``[num_layers, num_experts, 2 * moe_ffn, hidden]`` (``linear_fc2``: ``[L, E, hidden, moe_ffn]``),
with the layer and the expert as prepended axes and the expert-TP split (gated fc1: two pieces,
gate and up rows) on the remaining dims; expert-data-parallel copies are replicas. The router
(``mlp.router.weight``, and the persistent ``expert_bias`` buffer of aux-loss-free balancing) is
replicated like a norm; shared experts are split like the dense MLP. So the pieces of two
layouts with different ep/etp/tp describe the same global tensors, and the planner moves
experts point to point like any weight.

Persistent buffers in ``sharded_state_dict()`` (today only the router's ``expert_bias``, which
megatron-core updates in place after each optimizer step) are pieces too: they are model state
that a phase copy must receive. Every parameter must be covered exactly by its pieces (checked),
so a parameter that Megatron's checkpoint geometry leaves out cannot silently stay behind.

Parts of ``sharded_state_dict()`` read Megatron's global parallel state (DP/CP replica ids, layer
offsets), so call ``shard_pieces`` while the model's own layout is the current one; the pieces stay
valid (they are views) after the layout changes. They alias the parameters' storage at the time
of the call: take them after anything that re-binds ``param.data`` (Megatron DDP moves parameters
into its contiguous buffer when it wraps the model).

Region arithmetic (``intersect``, ``region_shape``, ``relative``) is pure and shared by the
planners. No communication here: ``shard_pieces`` is local; planners combine the pieces of many
ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megatron_earl.parallel.ddp import unwrap_chunk

Region = tuple[tuple[int, int], ...]
"""[start, stop) per dimension of a global tensor."""


@dataclass(frozen=True)
class ShardPiece:
    """One contiguous region of a global tensor held by a local parameter view."""

    key: str
    """Global tensor key (Megatron checkpoint key, layer-stacked: no layer number)."""
    global_shape: tuple[int, ...]
    """Shape of the whole global tensor."""
    region: Region
    """The region of the global tensor this piece holds."""
    local: torch.Tensor
    """View into the local parameter with the region's shape (prepended axes squeezed)."""
    param_name: str
    """Name of the local parameter (``chunk{i}.`` + module path)."""
    param: torch.Tensor
    """The local parameter (or persistent buffer, e.g. the router's ``expert_bias``) ``local``
    is a view of."""
    is_replica: bool
    """True when another rank holds the same region as the main replica (DP/CP/PP copies)."""

    @property
    def numel(self) -> int:
        return self.local.numel()

    def view_of(self, other: torch.Tensor) -> torch.Tensor:
        """The same view into ``other`` (e.g. the parameter's gradient), which must be laid out
        like the parameter."""
        if other.shape != self.param.shape or other.stride() != self.param.stride():
            raise ValueError(f"{self.param_name}: tensor is not laid out like its parameter")
        offset = self.local.storage_offset() - self.param.storage_offset()
        return other.as_strided(
            self.local.size(), self.local.stride(), other.storage_offset() + offset
        )

    def region_view(self) -> torch.Tensor:
        """``local`` with the region's full shape (squeezed prepended axes restored as size 1)."""
        view = self.local
        for _ in range(len(self.region) - view.dim()):
            view = view.unsqueeze(0)
        assert tuple(view.shape) == region_shape(self.region), (self.key, view.shape, self.region)
        return view


def _pieces_of(sh_ten, param_name: str, param: torch.Tensor) -> ShardPiece:
    if sh_ten.flattened_range is not None:
        raise ValueError(f"{sh_ten.key}: flattened (distributed-optimizer) shards are not weights")
    n_pre = sh_ten.prepend_axis_num
    local_shape = (1,) * n_pre + tuple(sh_ten.local_shape)
    region = tuple(
        (off, off + size) for off, size in zip(sh_ten.global_offset, local_shape, strict=True)
    )
    replica = sh_ten.replica_id
    is_replica = any(replica) if isinstance(replica, tuple) else bool(replica)
    return ShardPiece(
        key=sh_ten.key,
        global_shape=tuple(sh_ten.global_shape),
        region=region,
        # A detached alias: copies into it (reshard, load) are plain storage writes, never
        # autograd view updates (Megatron builds fc1's halves as views under no_grad).
        local=sh_ten.data.detach(),
        param_name=param_name,
        param=param,
        is_replica=is_replica,
    )


def shard_pieces(model_chunks: list[nn.Module]) -> list[ShardPiece]:
    """Pieces of every parameter and persistent buffer of this rank's model chunks, in a
    deterministic order. Raises ``ValueError`` when a parameter is not covered exactly by its
    pieces (Megatron's checkpoint geometry leaves part of it out, or covers it twice).

    Local: no collective is called.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    pieces: list[ShardPiece] = []
    for index, chunk in enumerate(model_chunks):
        module = unwrap_chunk(chunk)
        # First: saving the router's state re-binds a non-fp32 expert_bias to fp32 storage
        # (megatron-core's ``_maintain_float32_expert_bias``); the pieces view the final storage.
        entries = list(module.sharded_state_dict().values())
        params = {id(p): (name, p) for name, p in module.named_parameters()}
        tensors = {**{id(b): (name, b) for name, b in module.named_buffers()}, **params}
        covered = dict.fromkeys(params, 0)
        for entry in entries:
            if isinstance(entry, ShardedTensorFactory):
                built = entry.build_fn(entry.key, entry.data, entry.replica_id, None)
                subs = built if isinstance(built, list) else list(built.values())
            elif isinstance(entry, ShardedTensor):
                subs = [entry]
            else:
                continue  # ShardedObject (_extra_state) and other non-tensor state
            if id(entry.data) not in tensors:
                continue  # a tensor made for the checkpoint, not held by the model
            name, tensor = tensors[id(entry.data)]
            new = [_pieces_of(sub, f"chunk{index}.{name}", tensor) for sub in subs]
            if id(tensor) in covered:
                covered[id(tensor)] += sum(p.numel for p in new)
            pieces.extend(new)
        wrong = {
            params[i][0]: (n, params[i][1].numel())
            for i, n in covered.items()
            if n != params[i][1].numel()
        }
        if wrong:
            raise ValueError(
                f"chunk {index}: parameters not covered exactly by their checkpoint shards "
                f"(elements covered, elements): {wrong}; they could not be resharded"
            )
    return pieces


def region_slices(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


def region_numel(region: Region) -> int:
    return math.prod(b - a for a, b in region)


def intersect(a: Region, b: Region) -> Region | None:
    """The common box of two regions of the same tensor, or None when they do not overlap."""
    if len(a) != len(b):
        raise ValueError(f"regions of different rank: {a} vs {b}")
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in box) else box


def relative(region: Region, origin: Region) -> Region:
    """``region`` (global coordinates) in the coordinates of the box ``origin`` that contains it."""
    out = tuple((a - o, b - o) for (a, b), (o, _) in zip(region, origin))
    if any(a < 0 or b > o1 - o0 for (a, b), (o0, o1) in zip(out, origin)):
        raise ValueError(f"region {region} is not inside {origin}")
    return out


@torch.no_grad()
def full_state_dict(
    model_chunks: list[nn.Module], *, replicas: bool = False
) -> dict[str, torch.Tensor]:
    """Global tensors assembled from this rank's pieces; the rank must hold the whole model
    (TP=CP=PP=1). Used for single-process references and tests. Local, no collective.
    ``replicas``: also read pieces another rank holds as the main replica (a DP copy)."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for piece in shard_pieces(model_chunks):
        full = out.setdefault(piece.key, torch.empty(piece.global_shape, dtype=piece.local.dtype))
        if piece.is_replica and not replicas:
            continue
        full[region_slices(piece.region)] = piece.region_view()
        covered[piece.key] = covered.get(piece.key, 0) + piece.numel
    missing = {
        k: (covered.get(k, 0), v.numel()) for k, v in out.items() if covered.get(k, 0) != v.numel()
    }
    if missing:
        raise ValueError(f"this rank does not hold whole tensors (covered, total): {missing}")
    return out


@torch.no_grad()
def load_full_state_dict(model_chunks: list[nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shards out of global tensors (e.g. from ``full_state_dict``). Local."""
    for piece in shard_pieces(model_chunks):
        if piece.key not in full:
            raise KeyError(f"global tensor {piece.key!r} missing; have {sorted(full)[:8]}...")
        src = full[piece.key]
        if tuple(src.shape) != piece.global_shape:
            raise ValueError(
                f"{piece.key}: global shape {tuple(src.shape)} != model's {piece.global_shape}"
            )
        piece.local.copy_(src[region_slices(piece.region)].reshape(piece.local.shape))
