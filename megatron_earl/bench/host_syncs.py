"""Host syncs a GPU would pay per train micro-batch and step, per experience (log-prob) step and
per embedded-engine decode step, counted on the emulation tier (``emulated_syncs``).

    megatron-earl bench host-syncs                        # the demo model, 2 and 8 layers
    megatron-earl bench host-syncs --layers 2 --settings tp1-tree --sites 10 --json

No GPU is used: every setting runs on local gloo processes under the emulation tier
(``MEGATRON_EARL_EMULATE_DEVICE=1``), which sees every device -> host synchronisation as an op
(docs/devices.md, "What is counted"). Settings (``--settings``):

- ``tp1-tree``: the demo's own path, one rank: the train and log-prob passes pack GRPO groups
  as prefix trees (``train.prefix_sharing``, cp = 1), the engine decodes at tp 1;
- ``tp1-whole``: one rank, every sample packed whole (thd ``cu_seqlens``);
- ``tp2``: 2 ranks, tensor parallel (prefix trees; the engine at tp 2);
- ``cp2``: 2 ranks, context parallel (whole samples, as cp > 1 always packs; no engine).

The model is ``--config``'s (``configs/demo_cpu.yaml``) at ``--layers`` layers each. The data are
GRPO groups of the demo's size (``SAMPLES_PER_PROMPT`` samples sharing a prompt), packed into
micro-batches of ``SAMPLES_PER_MICRO_BATCH`` samples with the fields the loop trains on. After a
warm-up step, a train step (``rl_step.train_micro_batches``) and a log-prob pass
(``rl_step.micro_batch_logprobs``) run on 2 and on 4 micro-batches: the difference gives the
syncs *per micro-batch*, the rest the syncs *per step*. The engine generates for
``NUM_REQUESTS`` sampled requests twice, ``SHORT`` and ``LONG`` new tokens each (no stop token,
so every row decodes every step): the difference over the decode steps' difference gives the
syncs *per decode step* (prefill and admission cancel out). Counts are rank 0's; with
``--sites`` the busiest call sites of each kind of step are printed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import torch

from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.config.model import ModelConfig, sequence_parallel_size
from megatron_earl.config.vocab import Phase
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed

SETTINGS = {
    "tp1-tree": ("tp1", True),
    "tp1-whole": ("tp1", False),
    "tp2": ("tp2", True),
    "cp2": ("cp2", False),
}
"""Setting -> (layout, prefix-tree packing)."""
SAMPLES_PER_PROMPT = 4
SAMPLES_PER_MICRO_BATCH = 8
PROMPT_LEN = 24
MICRO_BATCHES = (2, 4)
"""The two step sizes whose difference gives the per-micro-batch syncs."""
NUM_REQUESTS = 4
SHORT, LONG = 4, 12
EMULATED = {"MEGATRON_EARL_EMULATE_DEVICE": "1"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/demo_cpu.yaml", help="the model's config")
    p.add_argument("--layers", default="2,8", help="num_layers values, comma separated")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"of {list(SETTINGS)}")
    p.add_argument("--sites", type=int, default=0, help="call sites to print per step kind")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per setting")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        p.error(f"--settings {unknown}: valid settings are {list(SETTINGS)}")
    return args


# ---- in every rank ---------------------------------------------------------------------------


def _micro_batches(model: ModelConfig, layout: ParallelLayout, tree: bool, count: int, seed: int):
    """``count`` packed micro-batches of GRPO groups, as ``orchestration.samples.model_inputs``
    makes them from dispatched micro-batches (fields on the device)."""
    from megatron_earl import runtime
    from megatron_earl.training.microbatch import thd_micro_batch
    from megatron_earl.training.prefix_tree import tree_micro_batch

    gen = torch.Generator().manual_seed(seed)
    sp = sequence_parallel_size(model, layout.tp)
    out = []
    for m in range(count):
        parts: dict[str, list[torch.Tensor]] = {}
        lengths = []
        for _ in range(SAMPLES_PER_MICRO_BATCH // SAMPLES_PER_PROMPT):
            prompt = torch.randint(1, model.vocab_size, (PROMPT_LEN,), generator=gen)
            advantage = torch.randn((), generator=gen)
            for _ in range(SAMPLES_PER_PROMPT):
                n = int(torch.randint(16, 48, (), generator=gen))
                response = torch.randint(1, model.vocab_size, (n,), generator=gen)
                tokens = torch.cat([prompt, response])
                mask = torch.cat([torch.zeros(PROMPT_LEN - 1), torch.ones(n), torch.zeros(1)])
                sample = {
                    "tokens": tokens,
                    "labels": torch.cat([tokens[1:], tokens.new_zeros(1)]),
                    "loss_mask": mask,
                    "advantages": advantage.expand(len(tokens)) * mask,
                    "rollout_logprobs": -4.0 + 0.3 * torch.randn(len(tokens), generator=gen),
                }
                for k, v in sample.items():
                    parts.setdefault(k, []).append(v)
                lengths.append(len(tokens))
        fields = {k: runtime.to_device(torch.cat(v)) for k, v in parts.items()}
        ids = list(range(m * len(lengths), (m + 1) * len(lengths)))
        if tree:
            out.append(tree_micro_batch(fields, lengths, ids, sp))
        else:
            out.append(thd_micro_batch(fields, lengths, layout.cp, ids, sp))
    return out


def _counted(fn) -> dict[str, Any]:
    """The syncs of ``fn()``: total, by kind, by (kind, call site)."""
    from megatron_earl import emulated_device

    with emulated_device.host_syncs() as syncs:
        fn()
    return _summary(syncs)


def _split(
    small: dict[str, Any], large: dict[str, Any], small_units: int, large_units: int
) -> dict[str, Any]:
    """Syncs per unit (micro-batch, decode step) from two runs of ``small_units`` and
    ``large_units`` units, and the rest of the small run (per step, or per generation)."""
    units = large_units - small_units
    per_unit = (large["total"] - small["total"]) / units
    kinds = sorted(set(small["kinds"]) | set(large["kinds"]))
    return {
        "per_unit": per_unit,
        "fixed": small["total"] - small_units * per_unit,
        "bytes_per_unit": (large["read_bytes"] - small["read_bytes"]) / units,
        "kinds_per_unit": {
            k: (large["kinds"].get(k, 0) - small["kinds"].get(k, 0)) / units for k in kinds
        },
        "sites": large["sites"],
    }


def _measure(config_path: str, num_layers: int, layout_text: str, tree: bool) -> dict[str, Any]:
    from megatron_earl.config.loader import load_config

    run = load_config(config_path)
    model = dataclasses.replace(run.model, num_layers=num_layers)
    return measure_setting(
        model,
        run.train.loss,
        layout_text,
        tree,
        lr=run.train.lr,
        seed=run.seed,
        max_tokens=run.batch.max_tokens_per_micro_batch,
    )


def measure_setting(
    model: ModelConfig,
    loss: PolicyLossConfig,
    layout_text: str,
    tree: bool,
    *,
    lr: float = 3e-4,
    seed: int = 1234,
    max_tokens: int = 4096,
    decode: bool = True,
) -> dict[str, Any]:
    """The syncs of one setting (module docstring): "train" and "experience" per micro-batch
    (``per_unit``) and per step (``fixed``), "decode" per decode step (cp = 1 and ``decode``),
    each with counts by kind and by call site. Every rank of the world calls it, under the
    emulation tier; ``tests/emulation/test_host_syncs.py`` pins its figures."""
    from megatron.core import parallel_state

    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.training.rl_step import (
        RLStepConfig,
        micro_batch_logprobs,
        train_micro_batches,
    )
    from megatron_earl.training.setup import (
        OptimConfig,
        build_optimizer,
        wire_schedule_hooks,
        wrap_ddp,
    )

    layout = ParallelLayout.parse(layout_text)
    initialize_layout(layout)
    runtime.seed(seed)
    chunks = build_model(model)
    optim = OptimConfig(lr=lr, clip_grad=1.0)  # clipping on, as the demo's train.clip_grad
    ddp = wrap_ddp(chunks, optim)
    optimizer = build_optimizer(ddp, optim)
    wire_schedule_hooks(ddp, optimizer)
    step_config = RLStepConfig(
        loss=loss, max_tokens_per_micro_batch=max_tokens, vocab_size=model.vocab_size
    )
    batches = {n: _micro_batches(model, layout, tree, n, seed=n) for n in MICRO_BATCHES}
    train_micro_batches(ddp, optimizer, batches[MICRO_BATCHES[0]], step_config)  # warm-up
    train = [
        _counted(lambda b=batches[n]: train_micro_batches(ddp, optimizer, b, step_config))
        for n in MICRO_BATCHES
    ]
    logprobs = [
        _counted(lambda b=batches[n]: micro_batch_logprobs(ddp, b, vocab_size=model.vocab_size))
        for n in MICRO_BATCHES
    ]
    out = {
        Phase.TRAIN: _split(*train, *MICRO_BATCHES),
        Phase.EXPERIENCE: _split(*logprobs, *MICRO_BATCHES),
    }
    if layout.cp == 1 and decode:
        out["decode"] = _decode(chunks, model, seed)
    out["rank"] = parallel_state.get_tensor_model_parallel_rank()
    return out


def _decode(chunks, model: ModelConfig, seed: int) -> dict[str, Any]:
    """Syncs per decode step of the embedded engine (module docstring); {} on its peers."""
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        drive_all,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    config = EmbeddedEngineConfig(max_batch_size=NUM_REQUESTS, max_seq_len=64, seed=seed)
    engine = EmbeddedEngine(chunks, model, config)
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(1, model.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
        for _ in range(NUM_REQUESTS)
    ]

    async def driver(eng: EmbeddedEngine) -> list[tuple[dict[str, Any], int]]:
        runs = []
        for new_tokens in (SHORT, LONG):
            requests = [
                GenerateRequest(p, SamplingParams(max_new_tokens=new_tokens, seed=seed + i))
                for i, p in enumerate(prompts)
            ]
            before = eng.pace_stats.decode_steps
            done: list[Any] = []

            async def generate(reqs=requests, out=done) -> None:
                out.extend(await drive_all(eng, reqs))

            counts = await _counted_async(generate)
            runs.append((counts, eng.pace_stats.decode_steps - before))
        return runs

    runs = run_engine(engine, driver)
    if runs is None:
        return {}
    (short, short_steps), (long, long_steps) = runs
    split = _split(short, long, short_steps, long_steps)
    return {**split, "decode_steps": long_steps - short_steps, "rows": NUM_REQUESTS}


def _summary(syncs) -> dict[str, Any]:
    return {
        "total": syncs.total,
        "read_bytes": syncs.read_bytes,
        "kinds": {k.value: n for k, n in syncs.by_kind().items()},
        "sites": [[k.value, site, n] for (k, site), n in syncs.by_site().items()],
    }


async def _counted_async(fn) -> dict[str, Any]:
    """``_counted`` of a coroutine function (the engine steps on its own thread: counted too)."""
    from megatron_earl import emulated_device

    with emulated_device.host_syncs() as syncs:
        await fn()
    return _summary(syncs)


# ---- driver ----------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from megatron_earl.config.loader import load_config

    model = load_config(args.config).model
    layers = [int(x) for x in args.layers.split(",")]
    rows = []
    for name in args.settings.split(","):
        layout_text, tree = SETTINGS[name]
        layout = ParallelLayout.parse(layout_text)
        for num_layers in layers:
            results = run_distributed(
                _measure,
                layout.world_size,
                args=(args.config, num_layers, layout_text, tree),
                timeout_s=args.timeout,
                env=EMULATED,
            )
            rows.append({"setting": name, "num_layers": num_layers, **results[0]})
    return {
        "config": args.config,
        "model": {
            "hidden_size": model.hidden_size,
            "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.num_query_groups,
            "vocab_size": model.vocab_size,
        },
        "samples_per_micro_batch": SAMPLES_PER_MICRO_BATCH,
        "samples_per_prompt": SAMPLES_PER_PROMPT,
        "micro_batches": list(MICRO_BATCHES),
        "decode_rows": NUM_REQUESTS,
        "rows": rows,
    }


def _kinds(kinds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in kinds.items() if v) or "-"


def report(result: dict[str, Any], sites: int = 0) -> str:
    m = result["model"]
    lines = [
        f"host syncs per step kind, emulation tier, rank 0 ({result['config']}: hidden "
        f"{m['hidden_size']}, heads {m['num_attention_heads']}/{m['num_query_groups']}, vocab "
        f"{m['vocab_size']}; {result['samples_per_micro_batch']} samples per micro-batch in "
        f"groups of {result['samples_per_prompt']}; steps of {result['micro_batches']} "
        f"micro-batches; decode {result['decode_rows']} rows). to_device copies are not syncs "
        "(pinned and non-blocking on CUDA through runtime.to_device) and not in the totals.",
        "",
        f"{'setting':<10} {'layers':>6} {'kind':<10} {'per mb/dec':>10} {'per step':>9} "
        f"{'bytes/unit':>10}  per micro-batch / decode step by kind",
    ]
    for row in result["rows"]:
        for kind in (Phase.TRAIN, Phase.EXPERIENCE, "decode"):
            part = row.get(kind)
            if not part:
                continue
            lines.append(
                f"{row['setting']:<10} {row['num_layers']:>6} {kind:<10} "
                f"{part['per_unit']:>10g} {part['fixed']:>9g} {part['bytes_per_unit']:>10g}  "
                f"{_kinds(part['kinds_per_unit'])}"
            )
            for kind_name, site, n in part["sites"][:sites]:
                lines.append(f"{'':<30}{n:>6} {kind_name:<14} {site}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(list(argv) if argv is not None else None)
    result = measure(args)
    print(json.dumps(result) if args.json else report(result, args.sites), flush=True)
    return 0
