"""Multi-process training smoke run of a tiny Megatron GPT model on a fixed synthetic batch.

Run under torchrun (every rank runs this file):

    torchrun --standalone --nproc_per_node 2 -m megatron_earl.cli.smoke --layout tp2 --steps 20

or let the CLI start torchrun: ``megatron-earl smoke --nproc 2 --layout tp2``. Prints the loss of
every step from the rank that computes it (last pipeline stage, first TP/DP rank); it decreases.
"""

from __future__ import annotations

import argparse
import time

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="megatron_earl.cli.smoke", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--layout", default="tp2", help="parallel layout, e.g. tp2, pp2, dp2, tp1")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import destroy_layouts, use_layout
    from megatron_earl.training.setup import (
        OptimConfig,
        build_optimizer,
        wire_schedule_hooks,
        wrap_ddp,
    )
    from megatron_earl.training.step import synthetic_lm_batches, train_step

    args = parse_args(argv)
    model = ModelConfig(
        num_layers=4,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
    )
    runtime.initialize()
    layout = ParallelLayout.parse(args.layout)
    layout = ParallelLayout(
        tp=layout.tp,
        cp=layout.cp,
        pp=layout.pp,
        vpp=layout.vpp,
        dp=dist.get_world_size() // layout.model_parallel_size,
    )
    layout.validate(dist.get_world_size(), model)
    use_layout(layout)
    runtime.seed(args.seed)
    optim = OptimConfig(lr=args.lr, use_distributed_optimizer=args.distributed_optimizer)
    ddp = wrap_ddp(build_model(model, vpp=layout.vpp), optim)
    optimizer = build_optimizer(ddp, optim)
    wire_schedule_hooks(ddp, optimizer)
    batches = synthetic_lm_batches(
        model.vocab_size,
        num_micro_batches=4,
        micro_batch_size=2,
        seq_length=args.seq_length,
        seed=args.seed,
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = batches[dp_rank :: layout.dp]
    reporter = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and dp_rank == 0
    )
    if reporter:
        print(
            f"smoke: layout {layout}, {model.num_parameters():,} parameters, world "
            f"{dist.get_world_size()}",
            flush=True,
        )
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        metrics = train_step(ddp, optimizer, mine)
        if reporter:
            print(
                f"step {step:3d}  loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}"
                f"  {time.perf_counter() - start:.2f}s",
                flush=True,
            )
    destroy_layouts()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_earl.compat.processes import skip_exit_gc

    skip_exit_gc()
    main()
