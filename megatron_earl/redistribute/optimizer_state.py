"""Move a trainable model between parallel layouts: weights *and* Adam state, point to point.

    # layout A current: pieces_a = shard_pieces(ddp_a); opt_a = build_optimizer(ddp_a, ...)
    # use_layout(B):    ddp_b = wrap_ddp(build_model(...)); opt_b = build_optimizer(ddp_b, ...)
    stats = reshard_model_and_optimizer(pieces_a, opt_a, shard_pieces(ddp_b), opt_b)

Adam's per-parameter tensors (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad) are
laid out like their parameter, so each is viewed through the parameter's shard pieces
(``ShardPiece.view_of``) and moved exactly like the weights. With bf16/fp16 parameters Megatron's
optimizer updates fp32 *main* copies (``Float16OptimizerWithFloat16Params``): those move too, so
nothing is rounded on the way. Weights, main copies and moments travel in ONE plan of
``redistribute.weight_exec`` (keys suffixed per tensor kind), so the move costs one metadata
all-gather and the rounds of one reshard, with at most ``bucket_bytes`` of buffers per round.
The scalar ``step`` is the same for every parameter (Megatron steps them all together) and is set
on every new state entry.

Supported: Megatron's plain optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
possibly in a ``ChainedOptimizer``) over torch Adam/AdamW. Not supported: the distributed
optimizer (``use_distributed_optimizer=True``), whose state lives in flat per-DP-rank shards of
the grad buffer, not in tensors laid out like the parameters; ``check_supported`` says so.

Lazy initialisation: torch Adam creates a parameter's state (step 0, zero moments) in its first
``step()``. ``init_adam_state`` creates exactly that state up front (same dtypes and devices as
torch's lazy path), so a never-stepped optimizer can be moved, and its next step computes the
same update as lazy initialisation would have (``m = b1*0 + (1-b1)g``, ``v = b2*0 + (1-b2)g^2``,
step 0 -> 1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_earl.parallel.groups import host_group
from megatron_earl.redistribute.geometry import ShardPiece
from megatron_earl.redistribute.weight_exec import ReshardStats, reshard_weights

MAIN = "main_param"
"""Suffix of the fp32 main copies of bf16/fp16 parameters in the combined plan."""


def sub_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside ``optimizer`` (a ``ChainedOptimizer`` holds several)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def torch_optimizer(sub: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer a Megatron optimizer steps (None for stubs and other kinds)."""
    if isinstance(sub, torch.optim.Optimizer):
        return sub
    inner = getattr(sub, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def check_supported(optimizer: Any) -> None:
    """Raise ``ValueError`` unless ``optimizer``'s state can be moved between layouts. Local."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in sub_optimizers(optimizer):
        if isinstance(sub, DistributedOptimizer):
            raise ValueError(
                f"optimizer {type(sub).__name__} (use_distributed_optimizer=True) keeps Adam "
                "state in flat per-data-parallel-rank shards, which cannot be moved between "
                "layouts; supported: Megatron's plain optimizer (use_distributed_optimizer="
                "False: FP32Optimizer, Float16OptimizerWithFloat16Params) over torch Adam/AdamW"
            )
        inner = getattr(sub, "optimizer", sub)
        if inner is not None and not isinstance(inner, torch.optim.Adam):
            raise ValueError(
                f"optimizer {type(sub).__name__} steps a {type(inner).__name__}; supported: "
                "Megatron's plain optimizer over torch.optim.Adam/AdamW (per-parameter state)"
            )


@torch.no_grad()
def init_adam_state(optimizer: Any) -> None:
    """Create Adam's state (step 0, zero moments) for every parameter that has none yet, exactly
    as torch Adam's lazy initialisation in its first ``step()`` would. Local, no collective.

    ``optimizer``: a Megatron optimizer (plain, Float16, distributed, chained) or a torch one;
    optimizers other than torch Adam/AdamW are left alone."""
    for sub in sub_optimizers(optimizer):
        inner = torch_optimizer(sub)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            on_device = group.get("capturable", False) or group.get("fused", False)
            for p in group["params"]:
                if inner.state.get(p):
                    continue
                step = (
                    torch.zeros((), dtype=torch.float32, device=p.device)
                    if on_device
                    else torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
                )
                state = {
                    "step": step,
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                inner.state[p] = state


def _scalar_dtype() -> torch.dtype:
    """torch Adam's dtype of a CPU ``step`` (``optim.optimizer._get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _master_tensors(optimizer: Any) -> dict[int, tuple[torch.Tensor, dict[str, Any]]]:
    """``id(model parameter)`` -> (the tensor the optimizer updates, its Adam state): the
    parameter itself, or its fp32 main copy under ``Float16OptimizerWithFloat16Params``."""
    out: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
    for sub in sub_optimizers(optimizer):
        inner = torch_optimizer(sub)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                out[id(p)] = (p, inner.state[p])
        for model_group, main_group in zip(
            getattr(sub, "float16_groups", []), getattr(sub, "fp32_from_float16_groups", [])
        ):
            for model_param, main_param in zip(model_group, main_group):
                out[id(model_param)] = (main_param, inner.state[main_param])
    return out


def _state_pieces(
    pieces: Sequence[ShardPiece], optimizer: Any, keys: Sequence[str]
) -> list[ShardPiece]:
    """Pieces of the main copies (when distinct from the parameters) and of the state tensors
    ``keys``, each viewed like its parameter's piece and keyed ``{piece.key}.{kind}``."""
    masters = _master_tensors(optimizer)
    out = []
    for piece in pieces:
        if id(piece.param) not in masters:
            continue  # frozen parameter: no optimizer state (frozen in every layout)
        main, state = masters[id(piece.param)]
        tensors = {key: state[key] for key in keys}
        if main is not piece.param:
            tensors[MAIN] = main
        for kind, tensor in tensors.items():
            out.append(
                dataclasses.replace(
                    piece, key=f"{piece.key}.{kind}", local=piece.view_of(tensor), param=tensor
                )
            )
    return out


def _common_step(optimizer: Any) -> torch.Tensor:
    """The ``step`` every parameter of ``optimizer`` shares, agreed over the world (a rank that
    holds no parameter state learns it too; steps that differ raise on every rank). Every rank
    of the world calls (one all-reduce of host metadata on the host world group)."""
    steps = [float(state["step"]) for _, state in _master_tensors(optimizer).values() if state]
    bounds = [max(steps), -min(steps)] if steps else [-math.inf, -math.inf]
    agreed = torch.tensor(bounds, dtype=torch.float64, device="cpu")
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=host_group())
    high, low = float(agreed[0]), -float(agreed[1])
    if high != low:
        raise ValueError(
            f"Adam steps differ between parameters (from {low} to {high}): Megatron "
            "steps all parameters together; this state cannot be moved"
        )
    return agreed[0].cpu()


@torch.no_grad()
def reshard_model_and_optimizer(
    old_pieces: Sequence[ShardPiece],
    old_optimizer: Any,
    new_pieces: Sequence[ShardPiece],
    new_optimizer: Any,
    *,
    bucket_bytes: int = 64 << 20,
) -> ReshardStats:
    """Copy the weights, fp32 main copies and Adam state of ``old_pieces``' model into
    ``new_pieces``' model (another layout, same global model) in one reshard.

    ``old_pieces`` must have been taken in the old layout, ``new_pieces`` in the new one (after
    DDP wrapping); the parallel state may be anything when this is called. A never-stepped old
    optimizer gets its (zero) state first; the new one always does. Raises ``ValueError`` for an
    unsupported optimizer (``check_supported``) before any communication.

    Collective: every rank of the world calls it (one all-reduce, one metadata all-gather, then
    point-to-point rounds on the world group)."""
    check_supported(old_optimizer)
    check_supported(new_optimizer)
    init_adam_state(old_optimizer)
    init_adam_state(new_optimizer)
    keys = sorted(
        {
            key
            for _, state in _master_tensors(old_optimizer).values()
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        }
    )
    step = _common_step(old_optimizer)
    for _, state in _master_tensors(new_optimizer).values():
        state["step"].copy_(step)
    src = [*old_pieces, *_state_pieces(old_pieces, old_optimizer, keys)]
    dst = [*new_pieces, *_state_pieces(new_pieces, new_optimizer, keys)]
    return reshard_weights(src, dst, bucket_bytes=bucket_bytes)
