"""Peer benchmark: the same GRPO workload on this project and on Hugging Face TRL, interleaved.

    megatron-earl bench peer [--pairs 3] [--steps 4] [--workloads single-turn,multi-turn-tool]
        [--config configs/demo_cpu.yaml] [--nproc 2] [--work-dir runs/bench_peer] [--json F]
        [key=value ...]                       # overrides of the config, both sides
    (= python -m megatron_earl.orchestration.bench_peer ...; needs the [bench] extra: trl)

Workloads and the settings both sides share: ``orchestration.peer_workload``. For each workload
the shared start weights are made once (``peer_weights`` under torchrun: our initial policy,
after our SFT warm start for ``multi-turn-tool``; then ``convert mcore-to-hf``) and cached in the
work directory under a hash of the settings. Then ``--pairs`` times, for each workload: our run
(``megatron-earl train --nproc N`` with ``checkpoint.load`` = the Megatron copy), then the TRL run
(``orchestration.peer_trl``, one process, loading the HF copy), each in fresh processes.

Measured per run, steady state: the first (warm-up) step and the start-up are excluded. s/step =
mean wall time of the remaining steps (ours: ``time/step`` of the metrics log; TRL: optimizer
step begin -> end); tokens/s = their completion tokens / their time (completion tokens = the
model-generated, trainable tokens; tool outputs are not counted, on both sides). Printed per
workload: each side's median over the pairs, the median of the per-pair ratios ours/TRL, the
per-phase breakdown (ours: rollout / experience / train; TRL: generate+score / loss+optimizer)
and the settings. Figures from a busy machine say little: measure on a quiet one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_earl.orchestration.peer_workload import (
    WORKLOADS,
    PeerSettings,
    Workload,
    ours_overrides,
    workload_config,
)

OURS_PHASES = ("rollout", "experience", "train")
"""Our per-phase times (``time/<phase>`` in the metrics log)."""
TRL_PHASES = ("generate", "train")
"""TRL's per-phase times measured by ``peer_trl``: generation + rewards + advantages, then the
loss forward/backward and the optimizer step."""


@dataclass
class RunSummary:
    """One run's steady state."""

    s_per_step: float
    """Mean wall time of the measured steps."""
    tokens_per_s: float
    """Completion tokens of the measured steps / their time."""
    tokens_per_step: float
    """Mean completion tokens per measured step."""
    phases: dict[str, float] = field(default_factory=dict)
    """Mean time of each phase per measured step."""


def steady_state(steps: list[dict], tokens: list[float], phases: tuple[str, ...]) -> RunSummary:
    """Summary of ``steps`` (records with ``time/step`` and ``time/<phase>``; ``tokens`` their
    completion tokens) without the first (warm-up) step; needs at least two steps."""
    if len(steps) < 2 or len(tokens) != len(steps):
        raise ValueError(f"need >= 2 steps with token counts, got {len(steps)} / {len(tokens)}")
    kept, kept_tokens = steps[1:], tokens[1:]
    seconds = sum(r["time/step"] for r in kept)
    return RunSummary(
        s_per_step=seconds / len(kept),
        tokens_per_s=sum(kept_tokens) / seconds,
        tokens_per_step=sum(kept_tokens) / len(kept),
        phases={p: statistics.fmean(r[f"time/{p}"] for r in kept) for p in phases},
    )


def ours_summary(metrics_jsonl: Path) -> RunSummary:
    """Our run's summary from its metrics log (completion tokens per step = mean response
    length x trajectories: the loss-mask tokens)."""
    steps = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    tokens = [r["response_len/mean"] * r["rollout/trajectories"] for r in steps]
    return steady_state(steps, tokens, OURS_PHASES)


def trl_summary(result: dict) -> RunSummary:
    """The TRL run's summary from ``peer_trl``'s JSON document."""
    steps = result["steps"]
    return steady_state(steps, [r["completion_tokens"] for r in steps], TRL_PHASES)


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` with its output in ``log``; raises naming the log (and its tail) on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit {rc}); log {log}:\n{tail}")


def _threads(nproc: int) -> int:
    """Torch threads of each of our processes: ``OMP_NUM_THREADS`` when set, else the cores
    shared out (what ``megatron-earl train`` sets)."""
    return int(os.environ.get("OMP_NUM_THREADS", max(1, (os.cpu_count() or 1) // nproc)))


def _torchrun(module: str, nproc: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(_threads(nproc))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*cmd, f"--nproc_per_node={nproc}", "-m", module, *args], env


def start_weights(args, workload: Workload, settings: PeerSettings, root: Path) -> Path:
    """The workload's shared start weights (``<dir>/mcore`` and ``<dir>/hf``), made once per
    settings (cached under their hash in ``root``)."""
    key = json.dumps({"settings": settings.to_dict(), "overrides": args.overrides}, sort_keys=True)
    digest = hashlib.sha256(f"{args.config}\n{key}".encode()).hexdigest()[:12]
    out = root / f"weights-{workload.name}-{digest}"
    if (out / "hf" / "config.json").is_file():
        return out
    forced = [f"rollout.max_turns={workload.max_turns}", f"sft.steps={settings.sft_steps}"]
    cmd, env = _torchrun(
        "megatron_earl.orchestration.peer_weights",
        args.nproc,
        ["--config", args.config, "--out", str(out / "mcore"), *args.overrides, *forced],
    )
    _run(cmd, out / "weights.log", env)
    convert = [sys.executable, "-m", "megatron_earl.cli.main", "convert", "mcore-to-hf"]
    _run([*convert, "--ckpt", str(out / "mcore"), "--out", str(out / "hf")], out / "convert.log")
    return out


def run_ours(args, workload: Workload, weights: Path, root: Path, name: str) -> RunSummary:
    """One measured run of ours (fresh processes)."""
    overrides = ours_overrides(
        workload, init=str(weights / "mcore"), steps=args.steps, out=str(root), name=name
    )
    shutil.rmtree(root / name, ignore_errors=True)  # a fresh run: no metrics or checkpoint left
    cmd, env = _torchrun(
        "megatron_earl.cli.train",
        args.nproc,
        ["--config", args.config, *args.overrides, *overrides],
    )
    _run(cmd, root / f"{name}.log", env)
    return ours_summary(root / name / "metrics.jsonl")


def run_trl(args, settings_file: Path, weights: Path, root: Path, name: str) -> tuple:
    """One measured TRL run (a fresh process); (summary, the run's JSON document)."""
    out = root / f"{name}.json"
    cmd = [sys.executable, "-m", "megatron_earl.orchestration.peer_trl", "--settings"]
    cmd += [str(settings_file), "--hf", str(weights / "hf"), "--steps", str(args.steps)]
    _run([*cmd, "--out", str(out)], root / f"{name}.log")
    result = json.loads(out.read_text())
    return trl_summary(result), result


def report(name: str, settings: PeerSettings, pairs: list[tuple], info: dict) -> list[str]:
    """The printed lines of one workload: per pair, medians, ratio, phases, settings."""
    ratios = [o.tokens_per_s / t.tokens_per_s for o, t in pairs]
    lines = [f"== {name} =="]
    for i, (o, t) in enumerate(pairs):
        lines.append(
            f"  pair {i}: ours {o.s_per_step:.2f} s/step {o.tokens_per_s:.0f} tok/s | "
            f"TRL {t.s_per_step:.2f} s/step {t.tokens_per_s:.0f} tok/s | ratio {ratios[i]:.2f}"
        )
    for side, runs, phases in (
        ("ours", [o for o, _ in pairs], OURS_PHASES),
        ("TRL", [t for _, t in pairs], TRL_PHASES),
    ):
        phase_text = ", ".join(
            f"{p} {statistics.median(r.phases[p] for r in runs):.2f} s" for p in phases
        )
        lines.append(
            f"  {side:4s} median: {statistics.median(r.s_per_step for r in runs):.2f} s/step, "
            f"{statistics.median(r.tokens_per_s for r in runs):.0f} tokens/s, "
            f"{statistics.median(r.tokens_per_step for r in runs):.0f} tokens/step ({phase_text})"
        )
    lines.append(f"  ours/TRL tokens/s: median of per-pair ratios {statistics.median(ratios):.2f}")
    s = settings
    lines.append(
        f"  settings: {info['params']:,} params, {s.prompts_per_step} prompts x "
        f"{s.samples_per_prompt} samples, up to {s.max_turns} model turn(s) of "
        f"{s.max_new_tokens} new tokens, start weights after {s.sft_steps} SFT steps; ours "
        f"{info['nproc']} process(es) x {info['ours_threads']} torch thread(s); TRL "
        f"{info['trl_processes']} process x {info['trl_threads']} thread(s), generation: "
        f"{info['trl_generation']}; {info['steps']} steps per run, the first excluded"
    )
    return lines


def interleave(args, prepared: dict[str, tuple]) -> tuple[dict, dict]:
    """``--pairs`` x (for each workload: our run, then the TRL run). Returns each workload's
    (ours, TRL) summaries per pair and the settings the runs reported."""
    root = Path(args.work_dir)
    results: dict[str, list[tuple]] = {n: [] for n in prepared}
    info: dict[str, dict] = {}
    for pair in range(args.pairs):
        for name, (workload, _, settings_file, weights) in prepared.items():
            ours = run_ours(args, workload, weights, root, f"ours-{name}-{pair}")
            trl, doc = run_trl(args, settings_file, weights, root, f"trl-{name}-{pair}")
            results[name].append((ours, trl))
            info[name] = {
                "params": doc["params"],
                "nproc": args.nproc,
                "ours_threads": _threads(args.nproc),
                "trl_processes": doc["processes"],
                "trl_threads": doc["torch_threads"],
                "trl_generation": doc["generation"],
                "steps": args.steps,
            }
            print(
                f"pair {pair} {name}: ours {ours.tokens_per_s:.0f} tokens/s, "
                f"TRL {trl.tokens_per_s:.0f} tokens/s",
                flush=True,
            )
    return results, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo_cpu.yaml", help="our side's base config")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved (ours, TRL) pairs")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run (first excluded)")
    parser.add_argument("--nproc", type=int, default=2, help="our processes (torchrun)")
    parser.add_argument("--work-dir", default="runs/bench_peer")
    parser.add_argument("--json", default="", help="write every run's summary here")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. seed=7")
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or args.pairs < 1 or args.steps < 2:
        parser.error(
            f"workloads {unknown} not in {sorted(WORKLOADS)}, or --pairs {args.pairs} < 1, "
            f"or --steps {args.steps} < 2 (the first step is excluded)"
        )
    root = Path(args.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    prepared = {}
    for name in names:
        workload = WORKLOADS[name]
        settings = PeerSettings.from_run(
            workload_config(args.config, workload, args.overrides), workload
        )
        settings_file = root / f"settings-{name}.json"
        settings_file.write_text(json.dumps(settings.to_dict(), indent=1))
        prepared[name] = (
            workload,
            settings,
            settings_file,
            start_weights(args, workload, settings, root),
        )
    results, info = interleave(args, prepared)
    for name in names:
        print("\n".join(report(name, prepared[name][1], results[name], info[name])), flush=True)
    if args.json:
        doc = {
            n: {
                "settings": prepared[n][1].to_dict(),
                "info": info[n],
                "pairs": [{"ours": asdict(o), "trl": asdict(t)} for o, t in results[n]],
            }
            for n in names
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
