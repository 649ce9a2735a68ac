"""The experts a mixture-of-experts model routes each token to: recorded in one forward, replayed
in another (routing replay, "R3"), through megatron-core's own ``RouterReplay``.

    routers = moe_routers(chunks)                    # this rank's routers, in layer order
    with recording(routers) as routes:               # the engine's forward
        model(...)
    routes()                                         # [tokens, layers, topk] int64
    with replaying(routers, target_TLk):             # the trainer's forward
        model(...)                                   # routed exactly as ``target_TLk`` says

Every MoE model here is built with ``moe_enable_routing_replay`` (``config.model``): each
``TopKRouter`` then holds a ``RouterReplay``, which routes natively unless an action is set. The
process-wide list megatron-core keeps of those (``RouterReplay.global_router_replay_instances``)
spans every model the process ever built (an engine's and a trainer's, every layout's), so this
module never uses it: ``moe_routers`` takes the routers of the given chunks only.

A route is the *set* of ``topk`` experts of a token at a layer (``[T, L, k]``, the order within a
row carries no meaning: megatron-core scatters the probabilities by index). Replaying rows that
are not ``k`` distinct experts in ``[0, num_experts)`` is refused where they enter (the agent
loop, ``check_routes``).

Tokens: the rows are the tokens the router sees on this rank, in its order -- the micro-batch's
tokens after the context-parallel split and, under sequence parallelism, this TP rank's
contiguous slice (``sequence_parallel_slice``). Pure bookkeeping on the routers; no
communication.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


class RouteAction(str, enum.Enum):
    """What a forward does with the rollout's routes (a micro-batch's ``routing``; measuring is
    a ``Disagreement`` there instead, the counter the forward adds to)."""

    REPLAY = "replay"
    """Route every token as the rollout did."""


class RoutingError(ValueError):
    """Routes that cannot be replayed on this model; the message names the values involved."""


@dataclass(frozen=True)
class MoERouter:
    """One MoE layer's router on this rank."""

    layer: int
    """The layer's index in the whole model (0-based; a pipeline stage holds a range)."""
    replay: object
    """Its megatron-core ``RouterReplay``."""
    topk: int


_CHUNK_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""chunk -> its routers: a cache (a walk over every module per micro-batch is avoidable work),
weak so a rebuilt layout's chunks leave it with them."""


def chunk_routers(chunk: nn.Module) -> list[MoERouter]:
    """``moe_routers([chunk])``, found once per chunk; their layers are one contiguous range (a
    chunk is a run of consecutive layers, with virtual pipeline stages too)."""
    if chunk not in _CHUNK_ROUTERS:
        _CHUNK_ROUTERS[chunk] = moe_routers([chunk])
    return _CHUNK_ROUTERS[chunk]


def moe_routers(chunks: Sequence[nn.Module]) -> list[MoERouter]:
    """The routers of ``chunks``' MoE layers, in layer order (empty for a dense model). Raises
    ``RoutingError`` for an MoE layer built without ``moe_enable_routing_replay``."""
    routers = []
    for chunk in chunks:
        for module in chunk.modules():
            router = getattr(getattr(module, "mlp", None), "router", None)
            if router is None or not hasattr(module, "layer_number"):
                continue
            if getattr(router, "router_replay", None) is None:
                raise RoutingError(
                    f"layer {module.layer_number - 1}: its router was built without "
                    "moe_enable_routing_replay (build the model with config.model's "
                    "build_transformer_config)"
                )
            routers.append(MoERouter(module.layer_number - 1, router.router_replay, router.topk))
    return sorted(routers, key=lambda r: r.layer)


def check_routes(routes_TLk: torch.Tensor, layers: int, topk: int, experts: int) -> None:
    """Raise ``RoutingError`` unless ``routes_TLk`` is ``[T, layers, topk]`` integer expert ids
    in ``[0, experts)``, each row ``topk`` distinct experts (host tensors: it reads them)."""
    if routes_TLk.dim() != 3 or tuple(routes_TLk.shape[1:]) != (layers, topk):
        raise RoutingError(
            f"routes of shape {tuple(routes_TLk.shape)}; this model needs [tokens, {layers} "
            f"layers, top-{topk}]"
        )
    if routes_TLk.dtype.is_floating_point or routes_TLk.dtype == torch.bool:
        raise RoutingError(f"routes must be integer expert ids, got {routes_TLk.dtype}")
    if routes_TLk.numel() == 0:
        return
    low, high = int(routes_TLk.min()), int(routes_TLk.max())
    if low < 0 or high >= experts:
        raise RoutingError(
            f"routes name experts in [{low}, {high}]; this model has experts [0, {experts})"
        )
    ordered = routes_TLk.sort(dim=-1).values
    twice = (ordered[..., 1:] == ordered[..., :-1]).nonzero()
    if topk > 1 and twice.numel():
        token, layer, slot = twice[0].tolist()
        raise RoutingError(
            f"the route of token {token} at layer {layer} names expert "
            f"{int(ordered[token, layer, slot])} twice; each route needs {topk} distinct experts"
        )


def filled(routes_TLk: torch.Tensor) -> torch.Tensor:
    """``routes_TLk`` with the rows of positions no engine computed (-1: packing padding, a
    trajectory's last token and trailing observation tokens) set to experts ``0..k-1``. Such
    positions come after every token whose log-probability is trained (or are padding), so
    their routing changes none of them."""
    topk = routes_TLk.size(-1)
    arange = torch.arange(topk, device=routes_TLk.device, dtype=routes_TLk.dtype)
    return torch.where(routes_TLk[..., :1] < 0, arange, routes_TLk)


def sequence_parallel_slice(routes_TLk: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """The rows this TP rank's routers see under sequence parallelism: its contiguous ``1/tp``
    of the tokens (Megatron's scatter to the sequence-parallel region)."""
    tokens = routes_TLk.size(0)
    if tokens % tp:
        raise RoutingError(f"{tokens} tokens do not split over tp={tp} (sequence parallelism)")
    per = tokens // tp
    return routes_TLk[tp_rank * per : (tp_rank + 1) * per]


@contextlib.contextmanager
def recording(routers: Sequence[MoERouter]) -> Iterator[Callable[[], torch.Tensor]]:
    """Record the routes of the forwards inside the block; the yielded function returns those
    of the last forward, ``[T, L, k]`` on the routers' device (the layers this rank holds)."""
    # megatron-core only where a model runs: the module stays importable without it
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for r in routers:
        r.replay.clear_indices()
        r.replay.set_router_replay_action(RouterReplayAction.RECORD)

    def routes() -> torch.Tensor:
        recorded = [r.replay.get_recorded_indices() for r in routers]
        missing = [r.layer for r, idx in zip(routers, recorded) if idx is None]
        if missing:
            raise RoutingError(f"layers {missing} routed no token inside the recording block")
        return torch.stack(recorded, dim=1)

    try:
        yield routes
    finally:
        for r in routers:
            r.replay.clear_router_replay_action()
            r.replay.clear_indices()


@contextlib.contextmanager
def replaying(routers: Sequence[MoERouter], routes_TLk: torch.Tensor) -> Iterator[None]:
    """Route the forward inside the block as ``routes_TLk`` says (``[T, L, k]``: L = the layers
    of ``routers``, T = the tokens each router sees, on any device). One forward; a recompute in
    the backward pass (activation recomputation) is not replayed and is refused at start-up."""
    # megatron-core only where a model runs: the module stays importable without it
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if routes_TLk.dim() != 3 or routes_TLk.size(1) != len(routers):
        raise RoutingError(
            f"routes of shape {tuple(routes_TLk.shape)} for {len(routers)} MoE layers on this "
            "rank: need [tokens, layers, topk]"
        )
    routes_TLk = routes_TLk.long()
    for i, r in enumerate(routers):
        r.replay.clear_indices()
        r.replay.set_target_indices(routes_TLk[:, i])
        r.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for r in routers:
            r.replay.clear_router_replay_action()
            r.replay.clear_indices()


def disagreement(a_TLk: torch.Tensor, b_TLk: torch.Tensor) -> torch.Tensor:
    """Per (token, layer) ``[T, L]`` bool: whether the two routes name different expert sets."""
    return (a_TLk.sort(dim=-1).values != b_TLk.sort(dim=-1).values).any(dim=-1)


@dataclass
class Disagreement:
    """Running counts of (token, layer) routes where a native forward's routing differed from
    the rollout's (``measuring``), kept on the device until read."""

    differ: list[torch.Tensor] = field(default_factory=list)
    total: list[torch.Tensor] = field(default_factory=list)

    def add(self, differ: torch.Tensor, total: torch.Tensor) -> None:
        self.differ.append(differ)
        self.total.append(total)

    def merge(self, other: Disagreement) -> None:
        """Add ``other``'s counts (a completed phase's) to these."""
        self.differ += other.differ
        self.total += other.total

    def take(self) -> list[torch.Tensor] | None:
        """[differing, compared] summed since the last take, as 0-d device tensors; None if
        nothing was counted."""
        if not self.total:
            return None
        out = [torch.stack(self.differ).sum(), torch.stack(self.total).sum()]
        self.differ, self.total = [], []
        return out


@contextlib.contextmanager
def measuring(
    routers: Sequence[MoERouter], routes_TLk: torch.Tensor, into: Disagreement
) -> Iterator[None]:
    """Route the forward inside the block natively and add to ``into`` how many of its
    (token, layer) routes differ from ``routes_TLk`` where that names one (not -1)."""
    with recording(routers) as routes:
        yield
        native = routes()
    target = routes_TLk.to(native.device)
    valid = target[..., 0] >= 0
    differs = disagreement(native, target.long()) & valid
    into.add(differs.sum(), valid.sum())
