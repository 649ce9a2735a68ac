"""``megatron-earl bench async-sim``: the pipeline simulator projected to 64-1024 GPUs, sync vs
async, next to the published figures of RollArt, AReaL and Laminar. SIMULATED, not measured.

    megatron-earl bench async-sim [--gpus 64,128,256,512,1024] [--steps 6] [--seed 0] [--json]
    megatron-earl bench async-sim --config measured.json [--staleness 1,2] [--json]

For each GPU count the same workload (``Assumptions``: a 32B-class dense model, a long-tailed
agentic workload, per-token costs of an H100-class GPU) runs on two placements:

- **sync, colocated** (EARL, this project's default loop): every GPU serves rollout (engines of
  ``gpus_per_engine`` GPUs) until the step's slowest trajectory ends, then every GPU trains, then
  the engines take the new weights (``push_s_colocated``);
- **async, disaggregated** (RollArt / AReaL / Laminar style): ``rollout_fraction`` of the GPUs
  are engines, the rest train; AReaL's staleness rule with k = ``--staleness``; ``continue``
  partial rollouts (plus one ``restart`` row); pushes cost ``push_s_disaggregated``.

With ``--config FILE`` (a JSON object of ``SimConfig`` fields, e.g. filled from a paced run:
per-token decode time, env step time, measured lengths, train time per token, push time) the
simulator runs that pipeline instead, sync and async with each ``--staleness`` (continue, and
restart at the largest k), on the same engines and trainer: the figures to compare with the
paced benchmark's.

The printed ratio is async/sync trained trajectories per second over the steady steps (the first
``WARMUP_STEPS`` excluded). Every figure of ours is labelled ``simulated``; the papers' figures
are quoted with their own settings (``PUBLISHED``), which are not ours: the comparison says
whether the simulator lands in the same range, not that we reproduce them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from megatron_earl.bench.pipeline_sim import LengthDist, SimConfig, SimResult, simulate

WARMUP_STEPS = 1
"""Steps excluded from the steady throughput (async fills its pipeline in the first one)."""


@dataclass(frozen=True)
class Assumptions:
    """The projected system; every figure an assumption stated here (seconds, tokens)."""

    model: str = "32B dense, bf16, H100-class GPUs"
    """What the costs below stand for (documentation)."""
    gpus_per_engine: int = 4
    """GPUs of one rollout engine (TP4)."""
    slots_per_engine: int = 64
    """Trajectories one engine decodes together at most."""
    decode_s_per_token: float = 0.025
    """One decode step at batch 1 (TP4, 32B): 25 ms."""
    batch_slope: float = 0.01
    """+1% step time per extra running sequence (64 running: 1.63x the batch-1 step)."""
    train_gpu_s_per_token: float = 1.1e-3
    """GPU-seconds of trainer work per trained token: ~10 x 32e9 FLOPs (experience forwards +
    forward/backward) at ~300 TFLOP/s effective."""
    push_s_colocated: float = 2.0
    """Weights from the training to the rollout layout on the same GPUs (reshard + engine wake)."""
    push_s_disaggregated: float = 4.0
    """Bucketed NCCL push of 64 GB to every engine across nodes (engines paused meanwhile)."""
    lengths: LengthDist = field(
        default_factory=lambda: LengthDist.lognormal(median=1024, sigma=1.0, max_tokens=16384)
    )
    """Generated tokens per trajectory: lognormal, p99/p50 ~ 10 (Laminar's observation of
    reasoning/agentic lengths), clipped at a 16K context."""
    tokens_per_turn: int = 1024
    """Tokens of one model turn (a 16K trajectory has 16 turns)."""
    env_step_s: float = 2.0
    """Tool / environment time between turns."""
    prompt_tokens: int = 1024
    """Prompt tokens per trajectory (trained, not generated)."""
    group_size: int = 16
    """Trajectories per prompt (GRPO group)."""
    trajectories_per_gpu: int = 8
    """Batch size scales with the cluster: 8 trajectories per GPU per step (1024 GPUs: 512
    prompts x 16)."""
    rollout_fraction: float = 0.75
    """async: share of the GPUs serving rollout (AReaL's examples use ~3/4)."""

    def sync_config(self, gpus: int, steps: int, seed: int) -> SimConfig:
        return self._config(gpus, gpus, gpus, self.push_s_colocated, steps, seed)

    def async_config(
        self, gpus: int, steps: int, seed: int, k: int, partial: str = "continue"
    ) -> SimConfig:
        rollout = round(gpus * self.rollout_fraction / self.gpus_per_engine) * self.gpus_per_engine
        config = self._config(gpus, rollout, gpus - rollout, self.push_s_disaggregated, steps, seed)
        return dataclasses.replace(config, mode="async", max_staleness=k, partial_rollout=partial)

    def _config(
        self, gpus: int, rollout_gpus: int, train_gpus: int, push_s: float, steps: int, seed: int
    ) -> SimConfig:
        trajectories = self.trajectories_per_gpu * gpus
        if rollout_gpus < self.gpus_per_engine or train_gpus < 1 or trajectories % self.group_size:
            raise ValueError(
                f"{gpus} GPUs: {rollout_gpus} rollout GPUs (engines of {self.gpus_per_engine}), "
                f"{train_gpus} training GPUs, {trajectories} trajectories (groups of "
                f"{self.group_size}) do not make a pipeline; use more GPUs"
            )
        return SimConfig(
            num_engines=rollout_gpus // self.gpus_per_engine,
            slots_per_engine=self.slots_per_engine,
            decode_s_per_token=self.decode_s_per_token,
            batch_slope=self.batch_slope,
            lengths=self.lengths,
            tokens_per_turn=self.tokens_per_turn,
            env_step_s=self.env_step_s,
            prompt_tokens=self.prompt_tokens,
            group_size=self.group_size,
            prompts_per_step=trajectories // self.group_size,
            train_s_per_token=self.train_gpu_s_per_token / train_gpus,
            push_s=push_s,
            num_steps=steps,
            seed=seed,
        )


PUBLISHED = (
    {
        "system": "RollArt",
        "figure": "1.35-2.05x end-to-end training-time reduction",
        "versus": "monolithic and synchronous baselines",
        "settings": "multi-task agentic RL; disaggregated pools: compute-optimised GPUs (H800) "
        "for prefill/training, bandwidth-optimised GPUs (H20) for decoding, CPU clusters for "
        "environments, serverless reward; trajectory-level asynchrony with staleness-bounded "
        "weight sync; production run on >3,000 GPUs (arXiv v2 abstract: 1.31-2.05x)",
        "source": "arXiv 2512.22560 (abstract)",
    },
    {
        "system": "AReaL",
        "figure": "up to 2.77x training speedup",
        "versus": "synchronous systems with the same number of GPUs",
        "settings": "math and code reasoning (long chain-of-thought, single turn); fully "
        "asynchronous, staleness bound eta (max_head_offpolicyness), interruptible generation, "
        "decoupled (staleness-enhanced) PPO; H800 clusters (NeurIPS version: up to 2.57x vs the "
        "best synchronous systems)",
        "source": "arXiv 2505.24298 (abstract)",
    },
    {
        "system": "Laminar",
        "figure": "up to 5.48x training throughput",
        "versus": "state-of-the-art RL systems",
        "settings": "1024-GPU cluster; trajectory-level asynchrony (each trajectory generated "
        "and consumed on its own), relay workers as a distributed parameter service (rollouts "
        "pull weights anytime), dynamic repacking of long-tail trajectories onto few rollouts",
        "source": "arXiv 2510.12633 (abstract)",
    },
)
"""The published figures as the papers state them (not reproduced here)."""


def with_changes(assumptions: Assumptions, changes: list[str]) -> Assumptions:
    """``assumptions`` with each ``FIELD=VALUE`` applied (numbers; ``lengths.X`` changes the
    length distribution); a bad field or value raises ``ValueError`` naming it."""
    numeric = {
        f.name: f.type
        for f in dataclasses.fields(Assumptions)
        if f.type in ("int", "float", int, float)
    }
    for change in changes:
        name, _, value = change.partition("=")
        try:
            if name.startswith("lengths.") and name[8:] in ("scale", "shape", "max_tokens"):
                number = int(value) if name == "lengths.max_tokens" else float(value)
                lengths = dataclasses.replace(assumptions.lengths, **{name[8:]: number})
                assumptions = dataclasses.replace(assumptions, lengths=lengths)
            elif name in numeric:
                kind = int if numeric[name] in ("int", int) else float
                assumptions = dataclasses.replace(assumptions, **{name: kind(value)})
            else:
                raise ValueError(
                    f"--set {change!r}: unknown field {name!r}; valid: "
                    f"{[*sorted(numeric), 'lengths.max_tokens', 'lengths.scale', 'lengths.shape']}"
                )
        except (TypeError, ValueError) as err:
            if str(err).startswith("--set"):
                raise
            raise ValueError(f"--set {change!r}: {err}") from None
    return assumptions


def steady(result: SimResult) -> dict[str, float]:
    """Steady state, after ``WARMUP_STEPS``: s/step, trajectories/s, trainer idle fraction."""
    ends, waits, cfg = result.step_end_s, result.step_wait_s, result.config
    steps = len(ends) - WARMUP_STEPS
    span = ends[-1] - ends[WARMUP_STEPS - 1]
    per_step = cfg.prompts_per_step * cfg.group_size
    return {
        "s_per_step": span / steps,
        "trajectories_per_s": steps * per_step / span,
        "trainer_idle_fraction": (waits[-1] - waits[WARMUP_STEPS - 1]) / span,
    }


def _row(gpus: int, label: str, result: SimResult) -> dict[str, Any]:
    d = result.to_dict()
    cfg = result.config
    return {
        "gpus": gpus,
        "schedule": label,
        "engines": cfg.num_engines,
        **steady(result),
        "engine_utilization": d["engine_utilization"],
        "discarded_fraction": d["discarded_trajectories"]
        / max(1, d["discarded_trajectories"] + d["trained_trajectories"]),
        "wasted_tokens": d["wasted_tokens"],
        "max_staleness_seen": max(d["staleness_trajectories"]),
    }


def compare(config: SimConfig, staleness: list[int]) -> list[dict[str, Any]]:
    """``config`` (its own engines and trainer) in sync and in async with each k (continue, and
    restart at the largest): one row each, ``speedup`` = async/sync steady trajectories/s."""
    sync_config = dataclasses.replace(config, mode="sync")
    sync = _row(0, "sync", simulate(sync_config)) | {"speedup": 1.0}
    rows = [sync]
    for k, partial in [(k, "continue") for k in staleness] + [(max(staleness), "restart")]:
        async_config = dataclasses.replace(
            config, mode="async", max_staleness=k, partial_rollout=partial
        )
        row = _row(0, f"async k={k} {partial}", simulate(async_config))
        rows.append(row | {"speedup": row["trajectories_per_s"] / sync["trajectories_per_s"]})
    return rows


def project(
    gpu_counts: list[int],
    assumptions: Assumptions,
    *,
    steps: int,
    seed: int,
    staleness: list[int],
) -> list[dict[str, Any]]:
    """One row per (GPU count, schedule), with ``speedup`` = async/sync steady trajectories/s."""
    rows = []
    for gpus in gpu_counts:
        sync = _row(gpus, "sync colocated", simulate(assumptions.sync_config(gpus, steps, seed)))
        rows.append(sync | {"speedup": 1.0})
        runs = [(k, "continue") for k in staleness] + [(max(staleness), "restart")]
        for k, partial in runs:
            config = assumptions.async_config(gpus, steps, seed, k, partial)
            row = _row(gpus, f"async k={k} {partial}", simulate(config))
            rows.append(row | {"speedup": row["trajectories_per_s"] / sync["trajectories_per_s"]})
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'GPUs':>5} {'schedule':<22} {'engines':>7} {'s/step':>8} {'traj/s':>8} "
        f"{'speedup':>8} {'trainer idle':>12} {'engine util':>11} {'discarded':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.get('gpus', '-'):>5} {r['schedule']:<22} {r['engines']:>7} "
            f"{r['s_per_step']:>8.1f} {r['trajectories_per_s']:>8.2f} {r['speedup']:>7.2f}x "
            f"{r['trainer_idle_fraction']:>12.1%} {r['engine_utilization']:>11.1%} "
            f"{r['discarded_fraction']:>9.1%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Simulate, print the table (or one JSON line with ``--json``); ``report`` returns it."""
    report(argv)
    return 0


def report(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="megatron-earl bench async-sim", description=__doc__)
    p.add_argument("--gpus", default="64,128,256,512,1024", help="GPU counts, comma-separated")
    p.add_argument("--steps", type=int, default=6, help="training steps simulated per run")
    p.add_argument("--staleness", default="1,2,4", help="async max_staleness values")
    p.add_argument("--seed", type=int, default=0, help="seed of the length draws")
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="JSON of SimConfig fields (e.g. measured figures): simulate that pipeline, sync vs "
        "async, instead of the projection",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change one projection assumption (an Assumptions field, or lengths.scale / "
        "lengths.shape / lengths.max_tokens), e.g. --set rollout_fraction=0.5; repeatable",
    )
    p.add_argument("--json", action="store_true", help="print one machine-readable JSON line")
    args = p.parse_args(argv)
    try:
        gpu_counts = [int(g) for g in args.gpus.split(",")]
        staleness = [int(k) for k in args.staleness.split(",")]
    except ValueError:
        p.error(
            f"--gpus / --staleness take comma-separated integers, got {args.gpus!r} / "
            f"{args.staleness!r}"
        )
    if args.steps <= WARMUP_STEPS:
        p.error(
            f"--steps must be > {WARMUP_STEPS} (the warm-up steps are excluded), got {args.steps}"
        )
    if args.config is not None:
        return _measured(p, args, staleness)
    try:
        assumptions = with_changes(Assumptions(), args.set)
        rows = project(
            gpu_counts, assumptions, steps=args.steps, seed=args.seed, staleness=staleness
        )
    except ValueError as err:
        p.error(str(err))
    out = {
        "label": "SIMULATED projection (bench.pipeline_sim), not a measurement",
        "assumptions": dataclasses.asdict(assumptions)
        | {"lengths": assumptions.lengths.describe(seed=args.seed)},
        "steps": args.steps,
        "warmup_steps": WARMUP_STEPS,
        "rows": rows,
        "published": list(PUBLISHED),
    }
    if args.json:
        print(json.dumps(out))
        return out
    lengths = out["assumptions"]["lengths"]
    print(f"bench async-sim: {out['label']}")
    print(
        f"model: {assumptions.model}; engines of {assumptions.gpus_per_engine} GPUs, "
        f"{assumptions.slots_per_engine} slots; decode {assumptions.decode_s_per_token * 1e3:g} "
        f"ms/token (+{assumptions.batch_slope:.0%} per running sequence); train "
        f"{assumptions.train_gpu_s_per_token:g} GPU-s/token; push "
        f"{assumptions.push_s_colocated:g} s colocated / {assumptions.push_s_disaggregated:g} s "
        f"disaggregated; async rollout share {assumptions.rollout_fraction:.0%}"
    )
    print(
        f"workload: {assumptions.trajectories_per_gpu} trajectories/GPU/step in groups of "
        f"{assumptions.group_size}; lengths lognormal(median {lengths['scale']:g}, sigma "
        f"{lengths['shape']:g}, max {lengths['max_tokens']}): p50 {lengths['p50']}, p90 "
        f"{lengths['p90']}, p99 {lengths['p99']} (p99/p50 {lengths['p99_over_p50']:.1f}); "
        f"turns of {assumptions.tokens_per_turn} tokens, {assumptions.env_step_s:g} s env step"
    )
    print(f"steady state over steps {WARMUP_STEPS + 1}..{args.steps}\n")
    print(_table(rows))
    print("\npublished (their settings, not ours):")
    for pub in PUBLISHED:
        print(
            f"  {pub['system']}: {pub['figure']} vs {pub['versus']} -- {pub['settings']} "
            f"[{pub['source']}]"
        )
    return out


def _measured(
    p: argparse.ArgumentParser, args: argparse.Namespace, staleness: list[int]
) -> dict[str, Any]:
    try:
        with open(args.config) as f:
            config = SimConfig.from_dict(json.load(f))
    except (OSError, ValueError, TypeError) as err:
        p.error(f"--config {args.config}: {err}")
    rows = compare(config, staleness)
    out = {
        "label": "SIMULATED (bench.pipeline_sim) from the inputs of --config",
        "config": args.config,
        "lengths": config.lengths.describe(seed=config.seed),
        "rows": [{k: v for k, v in r.items() if k != "gpus"} for r in rows],
    }
    if args.json:
        print(json.dumps(out))
        return out
    print(f"bench async-sim: {out['label']} {args.config}")
    lengths = out["lengths"]
    print(
        f"lengths: p50 {lengths['p50']}, p90 {lengths['p90']}, p99 {lengths['p99']}, max "
        f"{lengths['max']}; {config.num_engines} engines x {config.slots_per_engine} slots; "
        f"steady state over steps {WARMUP_STEPS + 1}..{config.num_steps}\n"
    )
    print(_table(out["rows"]))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
