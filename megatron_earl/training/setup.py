"""Wrap model chunks in Megatron DDP and build Megatron's optimizer (plain or distributed).

Both run Megatron's own classes: ``DistributedDataParallel`` (grad buffers, DP reduce) and
``get_megatron_optimizer`` (Apex/TE fused Adam when present, torch AdamW otherwise; that torch
fallback runs torch's own fused kernel, ``fuse_torch_adam``). Call on every rank after the
parallel state exists.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_earl.config.optim import OptimConfig
from megatron_earl.parallel.ddp import unwrap_chunk
from megatron_earl.parallel.oom_agreement import agreement_point
from megatron_earl.redistribute.optimizer_state import sub_optimizers, torch_optimizer


def wrap_ddp(model_chunks: list[nn.Module], optim: OptimConfig) -> list[nn.Module]:
    """Megatron DDP around each chunk (grad buffers in fp32, no overlap: portable to gloo)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_config,
            module=chunk,
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(model_chunks)
    ]


def build_optimizer(ddp_chunks: list[nn.Module], optim: OptimConfig):
    """Megatron optimizer over the DDP-wrapped chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = ddp_chunks[0].config.params_dtype
    config = OptimizerConfig(
        optimizer=optim.optimizer,
        sgd_momentum=optim.sgd_momentum,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, ddp_chunks)
    fuse_torch_adam(optimizer)
    return optimizer


FUSED_DEVICES = frozenset({"cpu", "cuda"})
"""Devices of torch's fused Adam/AdamW kernel (the emulated device runs the per-tensor loop)."""


def fuse_torch_adam(optimizer: Any) -> None:
    """Run the torch Adam/AdamW inside Megatron's optimizer (its fallback without TE/Apex: a
    Python loop of ~8 ops per parameter, ``_single_tensor_adam``) as torch's fused kernel, one
    pass per parameter -- the same update up to float rounding -- where every parameter of a
    group is on ``FUSED_DEVICES``; elsewhere the loop. Also after optimizer state is loaded
    (``training.checkpoint``): torch restores the saved groups' ``fused`` with them, so it
    is set again here, and a group switched to the kernel gets its ``step`` counters as float32
    on the parameter's device, where the kernel reads them. Local."""
    for sub in sub_optimizers(optimizer):
        adam = torch_optimizer(sub)
        if not isinstance(adam, torch.optim.Adam):  # AdamW is one
            continue  # TE/Apex FusedAdam, SGD
        for group in adam.param_groups:
            fused = (
                all(p.device.type in FUSED_DEVICES for p in group["params"])
                and not group.get("foreach")
                and not group.get("differentiable")
            )
            if fused and not group.get("fused"):
                for p in group["params"]:
                    state = adam.state.get(p)
                    if state and "step" in state:
                        state["step"] = state["step"].to(p.device, torch.float32)
            group["fused"] = fused


def wire_schedule_hooks(ddp_chunks: list[nn.Module], optimizer=None) -> None:
    """Point the chunks' config at DDP's no-sync/finalize hooks (DP and embedding-group grad
    reduction) and the optimizer's loss scale, as Megatron-LM's training loop does. The finalize
    hook first passes an OOM agreement point (``parallel.oom_agreement``): under the selector's
    OOM recovery, an OOM on another rank during the forward/backward raises here on every rank,
    before any gradient is reduced or applied."""
    from megatron.core.distributed import finalize_model_grads

    def agreed_finalize_model_grads(*args, **kwargs):
        agreement_point()
        return finalize_model_grads(*args, **kwargs)

    config = unwrap_chunk(ddp_chunks[0]).config
    config.finalize_model_grads_func = agreed_finalize_model_grads
    config.no_sync_func = [c.no_sync for c in ddp_chunks]
    if len(ddp_chunks) == 1:
        config.no_sync_func = config.no_sync_func[0]
    config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None


def build_lr_scheduler(optimizer, optim: OptimConfig, total_steps: int):
    """Megatron-Core's ``OptimizerParamScheduler`` over ``optimizer`` for ``optim``'s schedule;
    ``total_steps`` (the run's optimizer steps) is the decay length when ``optim.lr_decay_steps``
    is None. Call ``set_lr_step(scheduler, step)`` before optimizer step ``step`` (0-based)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = optim.lr_decay_steps or total_steps
    warmup = optim.lr_warmup_steps
    if optim.lr_warmup_fraction is not None:
        warmup = int(optim.lr_warmup_fraction * decay)
    if warmup >= decay:
        raise ValueError(
            f"lr warm-up ({warmup} optimizer steps) must be shorter than the decay "
            f"({decay} steps): lower lr_warmup_steps or raise lr_decay_steps"
        )
    weight_decays = [group.get("weight_decay") for group in optimizer.param_groups]
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=optim.lr_warmup_init,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
        wsd_decay_steps=optim.lr_wsd_decay_steps,
        lr_wsd_decay_style=optim.lr_wsd_decay_style,
    )
    for group, weight_decay in zip(optimizer.param_groups, weight_decays, strict=True):
        group["weight_decay"] = weight_decay  # the constructor applied wd_mult: keep as built
    return scheduler


def set_lr_step(scheduler, step: int) -> float:
    """Set the optimizer's learning rate to the schedule's value at optimizer step ``step``;
    returns that rate. Stateless in the step, so a resumed run needs no saved scheduler state.

    Only the rate is set: weight decay stays ``optim.weight_decay`` on every parameter group
    as before (Megatron-LM's scheduler would also apply its ``wd_mult``, exempting biases and
    norm weights; not done here, to keep the numerics of existing runs)."""
    scheduler.num_steps = step
    for group in scheduler.optimizer.param_groups:
        group["lr"] = scheduler.get_lr(group)
    return scheduler.get_lr(scheduler.optimizer.param_groups[0])
