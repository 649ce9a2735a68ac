"""Benchmark: embedded-engine decode throughput (tokens/s) at several batch sizes.

    python scripts/bench_engine.py                       # batch 1, 8, 32 on this machine
    python scripts/bench_engine.py --tp 2 --batches 1,8 --layers 4 --hidden 256

For each batch size B, B concurrent greedy requests (``--prompt-len`` random prompt tokens,
``--new-tokens`` generated each, no stop) go to one engine with ``max_batch_size >= B``. Printed per
B: wall time, generated tokens, end-to-end tokens/s, and decode tokens/s = (B x (new - 1)) /
(time after the last prefill), i.e. excluding the prefill of the prompts. Best of ``--repeats``.
Runs on ``--tp`` local processes through ``run_distributed`` (gloo on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel processes")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="KV heads (GQA)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args(argv)


def _bench(args: argparse.Namespace, model: ModelConfig) -> dict[int, dict[str, float]] | None:
    from megatron_earl import runtime
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.models.gpt import build_model, pin_transformer_impl
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig, run_engine
    from megatron_earl.rollout.engine import GenerateRequest

    initialize_layout(ParallelLayout(tp=args.tp))
    runtime.seed(0)
    model = pin_transformer_impl(model, embedded_engine=True)
    chunks = build_model(model)
    batches = [int(b) for b in args.batches.split(",")]
    max_seq = args.prompt_len + args.new_tokens
    config = EmbeddedEngineConfig(
        max_batch_size=max(batches), max_seq_len=max_seq, max_prefills_per_step=max(batches)
    )
    engine = EmbeddedEngine(chunks, model, config)
    gen = torch.Generator().manual_seed(0)

    async def one(eng: EmbeddedEngine, batch: int, new_tokens: int) -> float:
        prompts = torch.randint(0, model.vocab_size, (batch, args.prompt_len), generator=gen)
        p = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        requests = [GenerateRequest(tuple(x.tolist()), p) for x in prompts]
        start = time.perf_counter()
        results = await asyncio.gather(*(eng.generate(r) for r in requests))
        assert all(len(r.output_ids) == new_tokens for r in results)
        return time.perf_counter() - start

    async def driver(eng: EmbeddedEngine) -> dict[int, dict[str, float]]:
        await one(eng, 1, 4)  # warm-up
        out = {}
        for batch in batches:
            # Decode-only time: full run minus a prefill-only run (1 new token) of the same size.
            full = min([await one(eng, batch, args.new_tokens) for _ in range(args.repeats)])
            prefill = min([await one(eng, batch, 1) for _ in range(args.repeats)])
            generated = batch * args.new_tokens
            decode = batch * (args.new_tokens - 1) / max(full - prefill, 1e-9)
            out[batch] = {
                "wall_s": full,
                "tokens": generated,
                "tok_s": generated / full,
                "decode_tok_s": decode,
            }
        return out

    return run_engine(engine, driver)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    from megatron_earl.testing.distributed import run_distributed

    model = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len + args.new_tokens,
    )
    results: list[Any] = run_distributed(_bench, args.tp, args=(args, model), timeout_s=1800)
    table = results[0]
    print(
        f"embedded engine decode benchmark: tp={args.tp}, "
        f"{model.num_parameters() / 1e6:.2f}M params "
        f"(layers={args.layers} hidden={args.hidden} heads={args.heads}/{args.groups} "
        f"vocab={args.vocab}), prompt={args.prompt_len}, new={args.new_tokens}, greedy, fp32, "
        f"torch threads/rank={max(1, (os.cpu_count() or 1) // args.tp)}, best of {args.repeats}"
    )
    print(f"{'batch':>6} {'wall s':>8} {'tokens':>7} {'e2e tok/s':>10} {'decode tok/s':>13}")
    for batch, row in table.items():
        print(
            f"{batch:>6} {row['wall_s']:>8.2f} {row['tokens']:>7} {row['tok_s']:>10.1f} "
            f"{row['decode_tok_s']:>13.1f}"
        )
