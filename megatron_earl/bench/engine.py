"""Benchmark: the embedded engine's prefill and decode tokens/s next to Hugging Face
``transformers`` ``generate`` on the same model, weights, prompts and batch.

    megatron-earl bench engine                          # demo model, batch 64, prompt 32, 48 new
    megatron-earl bench engine --batches 1,8,32,64 --repeats 2        # a batch sweep
    megatron-earl bench engine --tp 2                   # ours on 2 TP processes, HF still on 1
    megatron-earl bench engine --compile-decode         # ours with torch.compile'd decode steps
    megatron-earl bench engine --compile-decode --compile-prefill   # ... and prefill steps
    megatron-earl bench engine --step-thread            # ours stepping in a worker thread
    megatron-earl bench engine --floor                  # ... and our prefill's projections alone
    megatron-earl bench engine model.num_layers=8 model.hidden_size=256   # another model shape
    python scripts/bench_engine.py --json               # one machine-readable line

Model: the ``model:`` section of ``--config`` (default ``configs/demo_cpu.yaml``, the demo model:
4 layers, hidden 128, FFN 256, 4 heads / 2 KV groups, vocabulary 320 padded to 384, untied, fp32)
plus dotted overrides. Megatron initialises it (seed ``--seed``) in one process; the same state is
loaded into our ranks and converted with the project's converter into a ``transformers`` model
(fp32, CPU, eval, SDPA attention; ``bench/engine_hf.py``). Before timing, the two models' logits
of one prompt must agree within ``engine_hf.LOGITS_TOL`` (else the run stops), and the greedy
tokens of both engines are compared (reported as a count: an fp32 near-tie may flip one).

Timing, per batch size B and per sampling mode (greedy; temperature 1 with no top-k/top-p, which
is what RL does): every request has a fresh random prompt of ``--prompt-len`` tokens (no prefix
cache hits), no stop token, and generates exactly the asked number of tokens (HF:
``min_new_tokens = max_new_tokens``, ``eos_token_id=None``). A *prefill run* generates 1 token, a
*full run* ``--new-tokens`` N; the two engines alternate (ours, HF, ours, HF, ...) on the same
prompts for ``--repeats`` rounds (each round: both prefill runs, then both full runs), and the
median times give

    prefill tok/s = B x prompt_len / prefill time
    decode tok/s  = B x (N - 1) / (full time - prefill time)

With ``--floor``, each round also times the matrix products our prefill run's steps run, alone
(``bench/engine_floor.py``: the projection-bound floor of our forward at this size), right after
HF's prefill run; HF's prefill time over theirs, per round, is the ours/HF prefill ratio our engine
would reach if everything else in its prefill run -- attention, norms, RoPE, cache writes, host
work -- took no time (printed as the *ceiling*). With ``--tp`` > 1: TP rank 0's shards on its
threads (one rank's part of each step; the other ranks wait, collectives not counted).

The ours/HF columns are *paired*: per round, HF's time over ours (prefill: the two prefill
runs; decode: each engine's full minus its prefill run of that round), then the median over the
rounds, printed with their range. The machine's speed drifts within minutes (up to ~2x here);
a round's two runs are back to back, so a drift moves both, where a ratio of medians taken over
minutes would carry it (``bench peer`` pairs its runs the same way).

Ours runs on ``--tp`` processes (gloo, ``torch`` threads = cores / tp each); HF runs in one process
(TP rank 0, threads = all cores, while the other ranks wait). Performance figures belong to a quiet
machine; on a shared one they only show the method works.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch

from megatron_earl.bench.engine_driver import drive
from megatron_earl.bench.engine_results import (
    ENGINES,
    SAMPLING_MODES,
    Agreement,
    EngineBenchConfig,
    EngineBenchResult,
    present_median,
)

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


def demo_model(config: str | Path = DEMO_CONFIG, overrides: list[str] | None = None):
    """The ``model:`` section of a run config file, with ``model.*`` dotted overrides."""
    from megatron_earl.config.loader import load_config

    return load_config(config, overrides or []).model


def _initial_state(cfg: EngineBenchConfig, prompt: torch.Tensor):
    """One process (TP1): the seeded Megatron weights as a full state dict and the logits
    comparison with their HF conversion. World of one; no collective."""
    from megatron_earl import runtime
    from megatron_earl.bench import engine_hf as bench_hf
    from megatron_earl.models.gpt import build_model
    from megatron_earl.models.impl import pin_transformer_impl
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import full_state_dict

    initialize_layout(ParallelLayout())
    runtime.seed(cfg.seed)
    model = pin_transformer_impl(cfg.model, embedded_engine=True)
    chunks = build_model(model)
    full = full_state_dict(chunks)
    hf = bench_hf.hf_model(full, model)
    diff, scale = bench_hf.logits_max_diff(chunks[0], hf, prompt, model.vocab_size)
    return full, diff, scale


def _bench_rank(cfg: EngineBenchConfig, full: dict[str, torch.Tensor]):
    """Every rank of the TP group: build our engine on ``full``; the scheduler (rank 0) also
    builds the HF model and drives the measurement (``bench/engine_driver.py``)."""
    import torch.distributed as dist

    from megatron_earl.bench import engine_hf as bench_hf
    from megatron_earl.models.gpt import build_model
    from megatron_earl.models.impl import pin_transformer_impl
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import load_full_state_dict
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )

    initialize_layout(ParallelLayout(tp=cfg.tp))
    model = pin_transformer_impl(cfg.model, embedded_engine=True)
    chunks = build_model(model)
    load_full_state_dict(chunks, full)
    biggest = max(cfg.batches)
    engine_config = EmbeddedEngineConfig(
        max_batch_size=biggest,
        max_seq_len=cfg.prompt_len + cfg.new_tokens,
        max_prefills_per_step=biggest,
        seed=cfg.seed,
        compile_decode=cfg.compile_decode,
        compile_prefill=cfg.compile_prefill,
        decode_threads=cfg.decode_threads,
        step_thread=cfg.step_thread,
    )
    engine = EmbeddedEngine(chunks, model, engine_config)
    hf = bench_hf.hf_model(full, model) if dist.get_rank() == 0 else None
    threads = torch.get_num_threads()
    out = run_engine(engine, lambda eng: drive(eng, hf, cfg))
    return None if out is None else (*out, threads, engine_config.decode_threads or threads)


def measure(cfg: EngineBenchConfig) -> EngineBenchResult:
    """Run the benchmark (spawns 1 then ``cfg.tp`` local processes) and collect the result."""
    import transformers

    from megatron_earl.bench import engine_hf as bench_hf
    from megatron_earl.testing.distributed import run_distributed

    prompt = torch.randint(
        0, cfg.model.vocab_size, (cfg.prompt_len,), generator=torch.Generator().manual_seed(1)
    )
    full, diff, scale = run_distributed(_initial_state, 1, args=(cfg, prompt), timeout_s=600)[0]
    if not diff <= bench_hf.LOGITS_TOL:
        raise RuntimeError(
            f"the HF conversion disagrees with the Megatron model: max |logit diff| {diff:.3g} > "
            f"{bench_hf.LOGITS_TOL} (max |logit| {scale:.3g}); timings would compare two functions"
        )
    per_rank = run_distributed(_bench_rank, cfg.tp, args=(cfg, full), timeout_s=3600)
    rows, ratios, greedy, warmup_s, threads, decode_threads = per_rank[0]
    m = cfg.model
    settings = {
        "model": (
            f"{m.num_layers} layers, hidden {m.hidden_size}, ffn {m.ffn_hidden_size}, heads "
            f"{m.num_attention_heads}/{m.query_groups} kv, vocab {m.vocab_size} (padded "
            f"{m.padded_vocab_size}), {'tied' if m.tie_embeddings else 'untied'}, "
            f"{m.params_dtype}, {m.num_parameters() / 1e6:.2f}M params"
        ),
        "batches": list(cfg.batches),
        "prompt_len": cfg.prompt_len,
        "group_size": cfg.group_size,
        "new_tokens": cfg.new_tokens,
        "repeats": cfg.repeats,
        "ours_processes": cfg.tp,
        "ours_threads_per_process": threads,
        "ours_decode_threads": decode_threads,
        "ours_compile_decode": cfg.compile_decode,
        "ours_compile_prefill": cfg.compile_prefill,
        "ours_step_thread": cfg.step_thread,
        "floor": cfg.floor,
        "ours_warmup_s": warmup_s,
        "hf_processes": 1,
        "hf_threads": os.cpu_count() or 1,
        "hf_attention": "sdpa",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cores": os.cpu_count() or 1,
    }
    agreement = Agreement(diff, bench_hf.LOGITS_TOL, scale, *greedy)
    return EngineBenchResult(settings, agreement, tuple(rows), tuple(ratios))


def _groups(size: int) -> str:
    return "every prompt distinct" if size == 1 else f"groups of {size} requests per prompt"


def format_report(result: EngineBenchResult) -> str:
    """The human-readable report: settings, agreement, one line per batch and sampling mode."""
    s, a = result.settings, result.agreement
    lines = [
        "bench engine: embedded engine (ours) vs transformers generate (HF), same weights/prompts",
        f"model: {s['model']}",
        f"ours: {s['ours_processes']} process(es) (tp={s['ours_processes']}) x "
        f"{s['ours_threads_per_process']} torch threads (decode steps: "
        f"{s['ours_decode_threads']}), steps "
        f"{'in a worker thread' if s['ours_step_thread'] else 'on the event loop thread'}, "
        f"compile_decode {'on' if s['ours_compile_decode'] else 'off'}, "
        f"compile_prefill {'on' if s['ours_compile_prefill'] else 'off'}"
        f" (untimed warm-up incl. any compilation: {s['ours_warmup_s']:.1f} s); "
        f"HF: 1 process x {s['hf_threads']} torch "
        f"threads, {s['hf_attention']} attention, transformers {s['transformers']}; torch "
        f"{s['torch']}, {s['cores']} cores",
        f"prompt {s['prompt_len']} tokens ({_groups(s['group_size'])}), {s['new_tokens']} new "
        "tokens per request (no stop), "
        f"median of {s['repeats']} interleaved repeats; ours/HF: median of the per-repeat "
        "ratios (range)",
        f"agreement: logits max |diff| {a.logits_max_diff:.2g} (tol {a.logits_tol:g}, max |logit| "
        f"{a.logits_max_abs:.2g}); first-token log p max |diff| {a.first_logprob_max_diff:.2g}; "
        f"greedy tokens agreeing {a.greedy_tokens_agree}/{a.greedy_tokens_compared}",
        f"{'batch':>5} {'sampling':>8} | {'prefill tok/s':>13} {'HF':>9} {'ours/HF':>26} | "
        f"{'decode tok/s':>12} {'HF':>9} {'ours/HF':>26}",
    ]
    for batch in s["batches"]:
        for sampling in SAMPLING_MODES:
            ours, hf = (result.row(batch, sampling, e) for e in ENGINES)
            paired = result.ratio(batch, sampling)
            lines.append(
                f"{batch:>5} {sampling:>8} | {ours.prefill_tok_s:>13.0f} {hf.prefill_tok_s:>9.0f} "
                f"{_ratio(paired.prefill):>26} | {ours.decode_tok_s:>12.0f} "
                f"{hf.decode_tok_s:>9.0f} {_ratio(paired.decode):>26}"
            )
    for paired in result.ratios if s["floor"] else ():
        ours = result.row(paired.batch, paired.sampling, ENGINES[0])
        floor_s = statistics.median(paired.floor_s)
        lines.append(
            f"floor {paired.batch:>4} {paired.sampling:>8} | our prefill's projections alone "
            f"{floor_s * 1e3:.2f} ms (our prefill run {ours.prefill_s * 1e3:.2f} ms); ceiling "
            f"of ours/HF prefill (HF's prefill run / them): {_ratio(paired.ceiling)}"
        )
    return "\n".join(lines)


def _ratio(values: tuple[float | None, ...]) -> str:
    """``median (min to max)`` of the per-repeat ratios, with the count of rounds left out
    (None: an outlier run, ``PairedRatio.decode``)."""
    median = present_median(values)
    if median is None:
        return f"n/a ({len(values)} out)"
    valid = [v for v in values if v is not None]
    dropped = f", {len(values) - len(valid)} out" if len(valid) < len(values) else ""
    return f"{median:.2f} ({min(valid):.2f} to {max(valid):.2f}{dropped})"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="model.* dotted overrides, e.g. model.num_layers=8")
    p.add_argument("--config", default=str(DEMO_CONFIG), help="run config whose model: is used")
    p.add_argument("--batches", default="64", help="comma-separated batch sizes, e.g. 1,8,32,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=EngineBenchConfig.repeats)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel processes of our engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-size", type=int, default=1, help="requests per prompt (8: GRPO groups)")
    p.add_argument(
        "--compile-decode",
        action="store_true",
        help="torch.compile our engine's decode step (compiled in the warm-up, time reported)",
    )
    p.add_argument(
        "--compile-prefill",
        action="store_true",
        help="torch.compile our engine's prefill steps (compiled in the warm-up, time reported)",
    )
    p.add_argument(
        "--decode-threads",
        type=int,
        default=EngineBenchConfig.decode_threads,
        help="torch threads of our engine's decode steps (0: every core, as HF gets; default 1)",
    )
    p.add_argument(
        "--step-thread",
        action="store_true",
        help="run our engine's steps in a worker thread, as serve and the trainer do (default: "
        "on the event loop thread, so that no second OpenMP team slows HF's side)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time our prefill run's projections alone each round and print HF's prefill "
        "time over theirs (the ceiling of the prefill ratio)",
    )
    p.add_argument("--json", action="store_true", help="print one machine-readable line")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        raise SystemExit(
            f"--batches must be comma-separated integers, got {args.batches!r}"
        ) from None
    model = demo_model(args.config, args.overrides)
    try:
        cfg = EngineBenchConfig(
            model=model,
            batches=batches,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            tp=args.tp,
            seed=args.seed,
            group_size=args.group_size,
            compile_decode=args.compile_decode,
            compile_prefill=args.compile_prefill,
            decode_threads=args.decode_threads,
            step_thread=args.step_thread,
            floor=args.floor,
        )
    except ValueError as err:  # a bad flag value: its message, no traceback
        raise SystemExit(f"bench engine: {err}") from None
    result = measure(cfg)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), allow_nan=False))
    else:
        print(format_report(result))
    return 0
