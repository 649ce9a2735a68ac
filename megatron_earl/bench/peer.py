"""Peer benchmark: the same GRPO workload on this project and on Hugging Face TRL, interleaved.

    megatron-earl bench peer [--pairs 3] [--steps 4] [--workloads single-turn,multi-turn-tool]
        [--config configs/demo_cpu.yaml] [--nproc 2] [--trl-nproc 1,2] [--json F]
        [--decode compiled|eager] [--work-dir runs/bench_peer]
        [key=value ...]   # overrides of the config, both sides
    (= python -m megatron_earl.bench.peer ...; needs the [bench] extra: trl)

Workloads and the settings both sides share: ``bench.peer_workload``. For each workload
the shared start weights are made once (``peer_weights`` under torchrun: our initial policy,
after our SFT warm start for ``multi-turn-tool``; then ``convert mcore-to-hf``) and cached in the
work directory under a hash of the settings. Then ``--pairs`` times, for each workload: our run
(``megatron-earl train --nproc N`` with ``checkpoint.load`` = the Megatron copy; ``--decode``:
our engine's decode step compiled, ``rollout.embedded.compile_decode=true``, the default, or
eager), then a TRL run
per ``--trl-nproc`` count (``bench.peer_trl`` loading the HF copy: one process, or that
many under torchrun on gloo, cores shared out as for ours), each in fresh processes.

Measured per run, steady state: the first (warm-up) step and the start-up are excluded. s/step =
mean wall time of the remaining steps (ours: ``time/step`` of the metrics log; TRL: optimizer
step begin -> end); tokens/s = their completion tokens / their time (completion tokens = the
model-generated, trainable tokens; tool outputs are not counted, on both sides). Printed per
workload: each run's median over the pairs, the median of the per-pair ratios ours/TRL (each
pair against its best TRL run, labelled with its process count), the per-phase breakdown (ours:
rollout / experience / train; TRL: generate, with rewards and advantages / update: loss and
optimizer), the token positions each update's forward computes per step next to the real
(prompt + completion) tokens (ours packs, and prefix sharing computes each group's prompt once;
TRL pads every sample to the longest prompt + longest completion of its batch, so the longest
conversation of a step sets its update's cost) and the settings. Figures from a busy machine
say little: measure on a quiet one.
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
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_earl.bench.peer_trl import TRL_GENERATE, TRL_UPDATE
from megatron_earl.bench.peer_workload import (
    WORKLOADS,
    PeerSettings,
    Workload,
    ours_overrides,
    workload_config,
)
from megatron_earl.config.vocab import Phase

DECODE_CHOICES = ("compiled", "eager")
"""``--decode``: our engine's decode step, ``rollout.embedded.compile_decode`` true or false."""
COMPILE_KEY = "rollout.embedded.compile_decode"

OURS_PHASES = tuple(p.value for p in Phase)
"""Our per-phase times (``time/<phase>`` in the metrics log)."""
TRL_PHASES = TRL_GENERATE, TRL_UPDATE
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
    phases: dict[str, float]
    """Mean time of each phase per measured step."""
    forward_per_step: float
    """Mean token positions the update's forward computes per measured step: ours the
    trajectories' tokens less the prompt tokens (all but the last) that prefix sharing does not
    compute again and less the zero-advantage samples' left out (``train.skip_zero_advantage``);
    TRL its padded batch, samples x (longest prompt + longest completion)."""
    real_per_step: float
    """Mean prompt + completion tokens per measured step (tool responses included)."""
    skipped_per_step: float = 0.0
    """Mean samples per measured step the update left out (ours: zero advantage; TRL: 0)."""


def steady_state(
    steps: list[dict],
    tokens: list[float],
    phases: tuple[str, ...],
    forward: list[float],
    real: list[float],
    skipped: list[float] | None = None,
) -> RunSummary:
    """Summary of ``steps`` (records with ``time/step`` and ``time/<phase>``; ``tokens`` their
    completion tokens, ``forward`` / ``real`` their update's forward positions and real tokens)
    without the first (warm-up) step; needs at least two steps."""
    counts = [len(tokens), len(forward), len(real)]
    if len(steps) < 2 or counts != [len(steps)] * 3:
        raise ValueError(
            f"need >= 2 steps with token counts, got {len(steps)} steps and {counts} counts"
        )
    kept, kept_tokens = steps[1:], tokens[1:]
    seconds = sum(r["time/step"] for r in kept)
    return RunSummary(
        s_per_step=seconds / len(kept),
        tokens_per_s=sum(kept_tokens) / seconds,
        tokens_per_step=sum(kept_tokens) / len(kept),
        phases={p: statistics.fmean(r[f"time/{p}"] for r in kept) for p in phases},
        forward_per_step=statistics.fmean(forward[1:]),
        real_per_step=statistics.fmean(real[1:]),
        skipped_per_step=statistics.fmean(skipped[1:]) if skipped else 0.0,
    )


def ours_summary(metrics_jsonl: Path) -> RunSummary:
    """Our run's summary from its metrics log (completion tokens per step = mean response
    length x trajectories: the loss-mask tokens; the train forward's positions = the
    trajectories' tokens less ``train/num_shared_tokens`` and ``train/num_skipped_tokens``: exact
    at tp1/cp1 when no trajectory failed, since ``rollout/tokens`` counts failed ones too and
    padding for SP/CP is left out)."""
    steps = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    tokens = [r["response_len/mean"] * r["rollout/trajectories"] for r in steps]
    real = [r["rollout/tokens"] for r in steps]
    forward = [
        r["rollout/tokens"] - r["train/num_shared_tokens"] - r.get("train/num_skipped_tokens", 0)
        for r in steps
    ]
    skipped = [r.get("train/num_skipped_samples", 0.0) for r in steps]
    return steady_state(steps, tokens, OURS_PHASES, forward, real, skipped)


def trl_summary(result: dict) -> RunSummary:
    """The TRL run's summary from ``peer_trl``'s JSON document."""
    steps = result["steps"]
    return steady_state(
        steps,
        [r["completion_tokens"] for r in steps],
        TRL_PHASES,
        [r["forward_positions"] for r in steps],
        [r["real_tokens"] for r in steps],
    )


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
        "megatron_earl.bench.peer_weights",
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
    overrides.append(f"{COMPILE_KEY}={args.decode == DECODE_CHOICES[0]}")
    shutil.rmtree(root / name, ignore_errors=True)  # a fresh run: no metrics or checkpoint left
    cmd, env = _torchrun(
        "megatron_earl.cli.train",
        args.nproc,
        ["--config", args.config, *args.overrides, *overrides],
    )
    _run(cmd, root / f"{name}.log", env)
    return ours_summary(root / name / "metrics.jsonl")


def run_trl(args, settings_file: Path, weights: Path, name: str, nproc: int) -> tuple:
    """One measured TRL run in fresh processes (``nproc`` > 1: under torchrun, gloo, each
    process ``cores / nproc`` threads); (summary, the run's JSON document)."""
    root = Path(args.work_dir)
    out = root / f"{name}.json"
    argv = ["--settings", str(settings_file), "--hf", str(weights / "hf")]
    argv += ["--steps", str(args.steps), "--out", str(out)]
    module = "megatron_earl.bench.peer_trl"
    if nproc == 1:
        cmd, env = [sys.executable, "-m", module, *argv], None
    else:
        cmd, env = _torchrun(module, nproc, argv)
    out.unlink(missing_ok=True)
    try:
        _run(cmd, root / f"{name}.log", env)
    except RuntimeError as err:
        # torchrun's gloo teardown sometimes aborts a rank after the run finished and rank 0
        # wrote every step ("terminate called without an active exception"): keep that run.
        done = out.is_file() and len(json.loads(out.read_text())["steps"]) == args.steps
        if not done:
            raise
        print(f"warning: {name} exited with an error after completing: {err}".splitlines()[0])
    result = json.loads(out.read_text())
    return trl_summary(result), result


@dataclass
class Pair:
    """One interleaved pair of a workload: our run and the TRL run of each process count."""

    ours: RunSummary
    """Our run."""
    trl: dict[int, RunSummary]
    """TRL run by number of processes."""

    @property
    def best_trl(self) -> int:
        """TRL's process count with the most tokens/s in this pair (the one compared with)."""
        return max(self.trl, key=lambda n: self.trl[n].tokens_per_s)

    @property
    def ratio(self) -> float:
        """Ours / TRL's best tokens/s."""
        return self.ours.tokens_per_s / self.trl[self.best_trl].tokens_per_s


def _median_line(label: str, runs: list[RunSummary], phases: tuple[str, ...]) -> str:
    skipped = statistics.median(r.skipped_per_step for r in runs)
    phase_text = ", ".join(
        f"{p} {statistics.median(r.phases[p] for r in runs):.2f} s" for p in phases
    )
    return (
        f"  {label} median: {statistics.median(r.s_per_step for r in runs):.2f} s/step, "
        f"{statistics.median(r.tokens_per_s for r in runs):.0f} tokens/s, "
        f"{statistics.median(r.tokens_per_step for r in runs):.0f} tokens/step ({phase_text}); "
        f"update forward over {statistics.median(r.forward_per_step for r in runs):.0f} "
        f"positions/step ({statistics.median(r.real_per_step for r in runs):.0f} real tokens"
        + (f", {skipped:.0f} zero-advantage samples left out)" if skipped else ")")
    )


def report(name: str, settings: PeerSettings, pairs: list[Pair], info: dict) -> list[str]:
    """The printed lines of one workload: per pair, medians, ratio, phases, settings."""
    lines = [f"== {name} =="]
    counts = sorted(pairs[0].trl)
    for i, pair in enumerate(pairs):
        trl = ", ".join(
            f"{n}p {pair.trl[n].s_per_step:.2f} s/step {pair.trl[n].tokens_per_s:.0f} tok/s"
            for n in counts
        )
        lines.append(
            f"  pair {i}: ours {pair.ours.s_per_step:.2f} s/step {pair.ours.tokens_per_s:.0f} "
            f"tok/s | TRL {trl} | ratio to TRL {pair.best_trl}p {pair.ratio:.2f}"
        )
    lines.append(_median_line("ours", [p.ours for p in pairs], OURS_PHASES))
    for n in counts:
        lines.append(_median_line(f"TRL {n}p", [p.trl[n] for p in pairs], TRL_PHASES))
    best = ", ".join(f"{n}p x{sum(p.best_trl == n for p in pairs)}" for n in counts)
    ratio = statistics.median(p.ratio for p in pairs)
    lines.append(
        f"  ours/TRL tokens/s: median of per-pair ratios {ratio:.2f} (each pair against its "
        f"best TRL run: {best})"
    )
    s = settings
    threads = ", ".join(f"{n}p x {info['trl_threads'][n]}" for n in counts)
    lines.append(
        f"  settings: {info['params']:,} params, {s.prompts_per_step} prompts x "
        f"{s.samples_per_prompt} samples, up to {s.max_turns} model turn(s) of "
        f"{s.max_new_tokens} new tokens, start weights after {s.sft_steps} SFT steps; ours "
        f"{info['nproc']} process(es) x {info['ours_threads']} torch thread(s), decode step "
        f"{info['ours_decode']}; TRL processes x "
        f"threads: {threads}, generation: {info['trl_generation']}; {info['steps']} steps per "
        "run, the first excluded"
    )
    return lines


def interleave(args, prepared: dict[str, tuple]) -> tuple[dict, dict]:
    """``--pairs`` x (for each workload: our run, then a TRL run per ``--trl-nproc``). Returns
    each workload's pairs and the settings the runs reported."""
    results: dict[str, list[Pair]] = {n: [] for n in prepared}
    info: dict[str, dict] = {}
    for i in range(args.pairs):
        for name, (workload, _, settings_file, weights) in prepared.items():
            ours = run_ours(args, workload, weights, Path(args.work_dir), f"ours-{name}-{i}")
            pair = Pair(ours, {})
            threads = {}
            for n in args.trl_nproc:
                pair.trl[n], doc = run_trl(args, settings_file, weights, f"trl{n}-{name}-{i}", n)
                threads[n] = doc["torch_threads"]
            results[name].append(pair)
            info[name] = {
                "params": doc["params"],
                "nproc": args.nproc,
                "ours_threads": _threads(args.nproc),
                "ours_decode": args.decode,
                "trl_threads": threads,
                "trl_generation": doc["generation"],
                "steps": args.steps,
            }
            trl = ", ".join(f"{n}p {pair.trl[n].tokens_per_s:.0f}" for n in args.trl_nproc)
            print(f"pair {i} {name}: tokens/s ours {ours.tokens_per_s:.0f}, TRL {trl}", flush=True)
    return results, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo_cpu.yaml", help="our side's base config")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved (ours, TRL) pairs")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run (first excluded)")
    parser.add_argument("--nproc", type=int, default=2, help="our processes (torchrun)")
    parser.add_argument(
        "--trl-nproc", default="1,2", help="TRL process counts to run per pair (best compared)"
    )
    parser.add_argument(
        "--decode",
        choices=DECODE_CHOICES,
        default=DECODE_CHOICES[0],
        help="our engine's decode step: torch.compile'd (rollout.embedded.compile_decode; "
        "compiled in the excluded first step) or eager",
    )
    parser.add_argument("--work-dir", default="runs/bench_peer")
    parser.add_argument("--json", default="", help="write every run's summary here")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. seed=7")
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    args.trl_nproc = sorted({int(n) for n in args.trl_nproc.split(",") if n})
    if unknown or args.pairs < 1 or args.steps < 2 or not args.trl_nproc or args.trl_nproc[0] < 1:
        parser.error(
            f"workloads {unknown} not in {sorted(WORKLOADS)}, or --pairs {args.pairs} < 1, "
            f"or --steps {args.steps} < 2 (the first step is excluded), or --trl-nproc "
            f"{args.trl_nproc} not positive counts"
        )
    if any(o.startswith(f"{COMPILE_KEY}=") for o in args.overrides):
        parser.error(
            f"give our decode step with --decode {'|'.join(DECODE_CHOICES)}, not {COMPILE_KEY}"
        )
    root = Path(args.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    prepared = {}
    for name in names:
        workload = WORKLOADS[name]
        config = workload_config(args.config, workload, args.overrides)
        settings = PeerSettings.from_run(config, workload)
        settings_file = root / f"settings-{name}.json"
        settings_file.write_text(json.dumps(settings.to_dict(), indent=1))
        weights = start_weights(args, workload, settings, root)
        prepared[name] = (workload, settings, settings_file, weights)
    results, info = interleave(args, prepared)
    for name in names:
        print("\n".join(report(name, prepared[name][1], results[name], info[name])), flush=True)
    if args.json:
        doc = {
            n: {
                "settings": prepared[n][1].to_dict(),
                "info": info[n],
                "pairs": [
                    {"ours": asdict(p.ours), "trl": {k: asdict(v) for k, v in p.trl.items()}}
                    for p in results[n]
                ],
            }
            for n in names
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
