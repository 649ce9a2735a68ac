"""``megatron-earl plan``: a dry run of the selector, or of a run config's memory, with no GPUs.

    megatron-earl plan configs/qwen2.5-7b_grpo.yaml --gpu h100-80gb [key=value ...] [--json]
    megatron-earl plan --model qwen2.5-72b --gpus 32 --gpu-memory 80 --context 4k,8k,16k,32k,64k
    python -m megatron_earl.selector.plan_cli --model configs/qwen2.5-7b_grpo.yaml --gpus 128 \
        --gpu-memory 80 --context 4k,64k --phase train --json

With a run config: each phase's predicted peak memory per GPU in the config's layouts, by term
(weights, train state, the embedded engine's KV cache, activations ...), and the headroom, on
``--gpu`` (a preset of ``footprint.GPU_PRESETS``; default: the GPU the config names on its
``# gpu: NAME`` line) or ``--gpu-memory`` GiB (``selector.footprint``). A config that does not
fit is refused (exit 1) naming the term and what would fix it.

With ``--model``:
prints, per context length and phase, the layout the selector would choose (memory model with the
analytic GPU defaults, roofline throughput: nothing measured), its predicted memory per GPU and
tokens/s, how many of the candidate layouts would run out of memory, and for each layout chosen
at some context the contexts at which that layout, kept static, would OOM.

``--model`` is a known name (``KNOWN_MODELS``: Qwen2.5-7B, Qwen2.5-72B, shapes from their public
HF configs) or a YAML/JSON file holding a ``ModelConfig`` (flat, or under a ``model:`` key as in
``configs/*.yaml``). The batch: ``--batch`` sequences of the context length per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from megatron_earl.config.loader import load_config
from megatron_earl.config.model import ModelConfig
from megatron_earl.config.run import ConfigError
from megatron_earl.config.vocab import PHASES
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.decide import NoFeasibleLayout, Selector, SelectorConfig
from megatron_earl.selector.footprint import (
    GPU_PRESETS,
    declared_gpu,
    footprint,
    format_footprint,
    gpu_preset,
)
from megatron_earl.selector.memory import GiB, MemoryModel, MemorySettings
from megatron_earl.selector.throughput import HardwareSpec, Roofline, ThroughputTable

_QWEN25 = dict(
    vocab_size=152064,
    make_vocab_size_divisible_by=128,
    max_position_embeddings=131072,
    rotary_base=1000000.0,
    norm_epsilon=1e-6,
    add_qkv_bias=True,
    tie_embeddings=False,
    params_dtype="bfloat16",
    recompute_granularity="full",
)
KNOWN_MODELS: dict[str, ModelConfig] = {
    "qwen2.5-7b": ModelConfig(
        num_layers=28,
        hidden_size=3584,
        ffn_hidden_size=18944,
        num_attention_heads=28,
        num_query_groups=4,
        **_QWEN25,
    ),
    "qwen2.5-72b": ModelConfig(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=29568,
        num_attention_heads=64,
        num_query_groups=8,
        **_QWEN25,
    ),
}
"""Shapes from the public Hugging Face configs (Qwen/Qwen2.5-7B, Qwen/Qwen2.5-72B)."""


def load_model(spec: str) -> ModelConfig:
    """A known model name (case-insensitive) or a YAML/JSON ``ModelConfig`` file."""
    known = KNOWN_MODELS.get(spec.lower())
    if known is not None:
        return known
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(
            f"--model {spec!r} is neither a known model {sorted(KNOWN_MODELS)} nor a file"
        )
    tree = yaml.safe_load(path.read_text()) or {}
    tree = tree.get("model", tree)
    try:
        return ModelConfig(**tree)
    except TypeError as err:
        raise SystemExit(f"--model {spec}: not a ModelConfig ({err})") from None


def parse_context(text: str) -> list[int]:
    """'4k,8k,32768' -> [4096, 8192, 32768]."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        scale = 1024 if item.endswith("k") else 1
        try:
            value = int(item.rstrip("k")) * scale
        except ValueError:
            raise SystemExit(
                f"--context: cannot parse {item!r}; expected e.g. 4k,8k,32768"
            ) from None
        if value < 1:
            raise SystemExit(f"--context: {item!r} must be >= 1 token")
        out.append(value)
    return out


def plan(
    model: ModelConfig,
    gpus: int,
    gpu_memory_gb: float,
    contexts: list[int],
    phases: list[str],
    *,
    batch: int = 64,
    token_budget: int = 16384,
    margin: float = 0.1,
    recompute: str | None = "model",
) -> dict:
    """The plan as a dict: rows per (context, phase) and static layouts' OOM contexts."""
    recompute = model.recompute_granularity if recompute == "model" else recompute
    memory = MemoryModel(model, MemorySettings.gpu(recompute=recompute))
    roofline = Roofline(model, HardwareSpec.h100(), recompute=recompute)
    config = SelectorConfig(
        budget_bytes=gpu_memory_gb * GiB, safety_margin=margin, token_budget=token_budget
    )
    rows, chosen = [], {p: [] for p in phases}
    for context in contexts:
        lengths = [context] * batch
        for phase in phases:
            selector = Selector(model, gpus, config, memory, ThroughputTable(roofline))
            row = {"context": context, "phase": phase}
            stats = selector.stats(phase, lengths)
            ranked = selector.rank(phase, lengths, stats)
            row["num_candidates"] = len(ranked)
            row["num_oom"] = sum(1 for c in ranked if not c.fits)
            try:
                decision = selector.decide(phase, lengths)
            except NoFeasibleLayout as err:
                row.update(layout=None, error=str(err))
            else:
                row.update(
                    layout=str(decision.layout),
                    memory_gb=decision.peak_bytes / GiB,
                    tokens_per_s=decision.tokens_per_s,
                )
                if str(decision.layout) not in chosen[phase]:
                    chosen[phase].append(str(decision.layout))
            rows.append(row)
    static = []
    for phase in phases:
        for name in chosen[phase]:
            layout = ParallelLayout.parse(name)
            selector = Selector(model, gpus, config, memory, ThroughputTable(roofline))
            ooms = {}
            for context in contexts:
                peak = selector.predicted_peak(phase, layout, [context] * batch)
                if peak * (1 + margin) > config.budget_bytes:
                    ooms[context] = peak / GiB
            static.append({"phase": phase, "layout": name, "oom_at": ooms})
    return {
        "model": model.to_dict(),
        "gpus": gpus,
        "gpu_memory_gb": gpu_memory_gb,
        "rows": rows,
        "static": static,
    }


def format_plan(result: dict, name: str) -> str:
    lines = [
        f"plan: {name} on {result['gpus']} GPUs x {result['gpu_memory_gb']:g} GB "
        "(predicted; no GPU used)",
        f"{'context':>8} {'phase':<11} {'layout':<16} {'mem/GPU GiB':>11} {'tokens/s':>12} "
        f"{'OOM layouts':>12}",
    ]
    for r in result["rows"]:
        ooms = f"{r['num_oom']}/{r['num_candidates']}"
        if r["layout"] is None:
            lines.append(
                f"{r['context']:>8} {r['phase']:<11} {'none fits':<16} {'-':>11} "
                f"{'-':>12} {ooms:>12}"
            )
            continue
        lines.append(
            f"{r['context']:>8} {r['phase']:<11} {r['layout']:<16} {r['memory_gb']:>11.1f} "
            f"{r['tokens_per_s']:>12.0f} {ooms:>12}"
        )
    lines.append("static layouts (each chosen at some context) would OOM at:")
    for s in result["static"]:
        where = ", ".join(f"{c} ({gb:.1f} GiB)" for c, gb in s["oom_at"].items()) or "never"
        lines.append(f"  {s['phase']:<11} {s['layout']:<16} {where}")
    return "\n".join(lines)


def plan_config(path: str, overrides: list[str], gpu: str | None, gpu_memory: float | None):
    """(the config's ``Footprint``, the GPU's name) for ``megatron-earl plan CONFIG``; raises
    ``ValueError`` for an unknown GPU or a config that names none, ``ConfigError`` for a bad
    config."""
    config = load_config(path, overrides)
    if gpu_memory is not None:
        return footprint(config, gpu_memory * GiB), f"{gpu_memory:g} GiB"
    name = gpu or declared_gpu(path)
    if name is None:
        raise ValueError(
            f"{path} names no GPU (a '# gpu: NAME' line); pass --gpu "
            f"({', '.join(GPU_PRESETS)}) or --gpu-memory GiB"
        )
    preset = gpu_preset(name)
    return footprint(config, preset.bytes), preset.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-earl plan", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="run config YAML: its memory per GPU")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    parser.add_argument("--gpu", help=f"GPU preset: {', '.join(GPU_PRESETS)}")
    parser.add_argument("--model", help="known name or YAML/JSON ModelConfig")
    parser.add_argument("--gpus", type=int, help="world size (with --model)")
    parser.add_argument("--gpu-memory", type=float, help="GiB per GPU (instead of --gpu)")
    parser.add_argument("--context", default="4k,8k,16k,32k,64k", help="e.g. 4k,8k,16k")
    parser.add_argument("--phase", default=",".join(PHASES), help="comma list of " + str(PHASES))
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--token-budget", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--margin", type=float, default=0.1, help="safety margin on memory")
    parser.add_argument(
        "--recompute", default="model", choices=["model", "none", "selective", "full"]
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        parser.error(f"--gpu-memory ({args.gpu_memory:g}) must be > 0 GiB")
    if args.gpu is not None and args.gpu.lower() not in GPU_PRESETS:
        parser.error(f"--gpu: unknown GPU {args.gpu!r}; valid: {', '.join(GPU_PRESETS)}")
    if args.config is not None:
        if args.model is not None:
            parser.error("give a run config or --model, not both")
        try:
            fp, gpu = plan_config(args.config, args.overrides, args.gpu, args.gpu_memory)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        except ValueError as err:
            parser.error(str(err))
        print(
            json.dumps(fp.as_dict(), indent=1)
            if args.json
            else format_footprint(fp, args.config, gpu)
        )
        return 1 if fp.problems else 0
    if args.model is None or args.gpus is None:
        parser.error("give a run config, or --model and --gpus")
    memory_gb = args.gpu_memory if args.gpu is None else GPU_PRESETS[args.gpu.lower()].memory_gib
    if memory_gb is None:
        parser.error("--model needs --gpu or --gpu-memory")
    phases = [p.strip() for p in args.phase.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if bad or args.gpus < 1 or args.batch < 1:
        parser.error(f"phases {bad} not in {PHASES}" if bad else "--gpus, --batch must be > 0")
    model = load_model(args.model)
    recompute = None if args.recompute == "none" else args.recompute
    result = plan(
        model,
        args.gpus,
        memory_gb,
        parse_context(args.context),
        phases,
        batch=args.batch,
        token_budget=args.token_budget,
        margin=args.margin,
        recompute=recompute,
    )
    print(json.dumps(result, indent=1) if args.json else format_plan(result, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
