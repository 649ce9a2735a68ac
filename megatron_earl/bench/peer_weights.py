"""The peer benchmark's shared start weights: our initial policy (after our SFT warm start when
the config asks for one), saved as a Megatron checkpoint; ``bench_peer`` then converts it to HF
(``megatron-earl convert mcore-to-hf``) so that both sides start from the same weights.

    torchrun --standalone --nproc_per_node 2 -m megatron_earl.bench.peer_weights \\
        --config configs/demo_cpu.yaml --out work/single-turn/mcore [key=value ...]

The policy is built exactly as a run builds it (``RLLoop``: same seed, same initialisation), the
warm start is ``RLLoop.warm_start`` (the ``sft`` section; ``sft.steps=0`` keeps the random
initial weights), and the checkpoint stores the model config and family (so the conversion
needs no ``--hf-config``). Which ranks call: every rank (under torchrun); rank 0 prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist

from megatron_earl.config.loader import load_config
from megatron_earl.config.run import CheckpointConfig, RunConfig
from megatron_earl.convert.families import family_for_model
from megatron_earl.orchestration.loop import RLLoop
from megatron_earl.parallel.state import destroy_layouts, use_layout
from megatron_earl.tokenizer import build_tokenizer
from megatron_earl.training import checkpoint as ckpt


def save_start_weights(config: RunConfig, out: str | Path) -> None:
    """Build the policy as a run of ``config`` does, take its SFT warm start (``sft.steps``, none
    when 0) and save it as step 0 under ``out``. Every rank calls."""
    loop = RLLoop(config, build_tokenizer(config.tokenizer))
    if config.sft.steps:
        loop.warm_start()
    use_layout(loop.policy.train_layout)
    ckpt.save_checkpoint(
        CheckpointConfig(dir=str(out), keep_last=1),
        0,
        loop.policy.ddp_chunks,
        weight_version=loop.policy.version,
        model_config=config.model,
        family=family_for_model(config.model).name,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo_cpu.yaml", help="YAML run config")
    parser.add_argument("--out", required=True, help="checkpoint directory to write (new)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.steps=150")
    args = parser.parse_args(argv)
    from megatron_earl import runtime

    runtime.initialize()
    config = load_config(args.config, args.overrides)
    start = time.perf_counter()
    save_start_weights(config, args.out)
    if dist.get_rank() == 0:
        print(
            f"start weights: {config.sft.steps} SFT steps, saved to {args.out} "
            f"in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
    destroy_layouts()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from megatron_earl.compat.processes import skip_exit_gc

    skip_exit_gc()
    sys.exit(main())
