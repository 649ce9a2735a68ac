"""``megatron-earl bench faults``: an asynchronous RL run on ``serve`` engines fed by relays,
with faults injected between steps (real processes, real signals), and what each one cost.

    megatron-earl bench faults [--down-s 4] [--json F]

Topology: engines e0, e1, e2 (``megatron-earl serve``); the root relay R0 (the trainer publishes
there: ``rollout.sglang.weight_update: relay``); R1 pulls from R0 and feeds e0 and e1; R2 pulls
from R1 or R0 and feeds e2. The trainer (``megatron-earl train --nproc 2``, ``rollout.mode:
async``, ``max_staleness: 1``) generates on all three engines through its pool (health checks
every ``--health-s``).

Faults (``FAULTS``), each lasting ``--down-s``:

- ``kill-engine`` e1: SIGKILL, restarted on its port after ``down_s``;
- ``stall-engine`` e2: SIGSTOP (a network stall: its socket accepts, nothing answers), SIGCONT
  after ``down_s``;
- ``kill-relay`` R1: SIGKILL, restarted after ``down_s`` (e0, e1 lag meanwhile; R2 pulls from R0);
- ``slow-relay`` R2: SIGSTOP for ``down_s`` (a relay that answers nothing for that long);
- ``kill-reward`` W: SIGKILL of the reward service (the run's remote reward worker, ``reward.
  service_url``, retried with backoff: ``reward.retries: 6``), restarted after ``down_s``;
- ``kill-trainer`` T: SIGKILL of ``megatron-earl train`` (its ranks die with it); the engines
  must keep answering meanwhile; after ``down_s`` the same command resumes from the newest
  checkpoint (``checkpoint.interval: 3``) and republishes (a newer publisher generation), and
  every engine must serve the resumed run's version. The steps after that checkpoint are redone
  (the metrics file keeps each step once); the resumed producers count from zero.

Fault i comes after step 1 + 8i (``EVERY``), or once fault i - 1 has recovered if that is
later; the trainer never waits for the suite. Engines decode at a paced 20 ms per step so a step
lasts long enough for a fault to hit it.

Per fault: the step it happened in, that step's time against the median of the fault-free
steps, and the recovery time: from the end of the fault (restart or SIGCONT) until every engine
answers ``/health`` and reports the newest version the trainer published. Per run: every step
completed, no trajectory lost or trained twice (the producer's counts at every step: produced =
consumed + discarded + buffered, consumed = steps x groups per step, each step's trajectories =
groups x samples), the pool's failovers and requests moved off the stalled engine, the relays'
counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from megatron_earl.config.loader import load_config
from megatron_earl.rewards.service import RewardServiceProcess, launch_reward_service
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.weights.relay.launch import RelayLaunch, RelayProcess
from megatron_earl.testing.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu_switching.yaml"
RUN = (
    "sft.steps=0",
    "eval.num_prompts=0",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "checkpoint.interval=3",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "logging.tensorboard=false",
    "logging.progress=false",
    "layouts.experience=tp1cp1pp1dp2",
    "rollout.engine=sglang",
    "rollout.mode=async",
    "rollout.max_staleness=1",
    "rollout.sglang.weight_update=relay",
)
GROUPS, SAMPLES = 4, 4
ENV = {"OMP_NUM_THREADS": "1"}
RELAY_ARGS = ("--engine-check-s", "0.5", "--poll-wait-s", "2")


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str


FAULTS = (
    Fault("kill-engine", "e1"),
    Fault("stall-engine", "e2"),
    Fault("kill-relay", "R1"),
    Fault("slow-relay", "R2"),
    Fault("kill-reward", "W"),
    Fault("kill-trainer", "T"),
)
EVERY = 8
"""Fault i comes after step 1 + EVERY x i (or when fault i - 1 has recovered, if later); the
run has EVERY x faults + 1 steps, so the trainer is still running when the last one ends."""
PACE_MS = 20
"""Engines' paced decode step (ms), so that a step lasts long enough for a fault to hit it."""


@dataclass
class FaultResult:
    kind: str
    target: str
    after_step: int
    injected_s: float
    ended_s: float = 0.0
    recovered_s: float | None = None
    """From the end of the fault until every engine is healthy on the newest version (after a
    trainer kill: on the version the resumed trainer republished)."""
    served_while_down: bool | None = None
    """kill-trainer: every engine answered ``/health`` throughout the trainer's outage."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Cluster:
    """The engines and relays of the suite, restartable by name."""

    tmp: Path
    engines: dict[str, ServerProcess] = field(default_factory=dict)
    relays: dict[str, RelayProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    reward: RewardServiceProcess | None = None

    def start(self, model_json: Path) -> None:
        for name in ("e0", "e1", "e2"):
            self.ports[name] = free_port()
            self.engines[name] = self._engine(name, model_json)
        for e in self.engines.values():
            e.wait_healthy(timeout_s=180)
        for name in ("R0", "R1", "R2"):
            self.ports[name] = free_port()
        for name in ("R0", "R1", "R2"):  # started together, then waited for
            self.relays[name] = self._relay(name)
        for r in self.relays.values():
            r.wait_healthy(timeout_s=60, path="/health")
        self._model_json = model_json
        self.ports["W"] = free_port()
        self.reward = self._reward()

    def _reward(self) -> RewardServiceProcess:
        return launch_reward_service({"exact": "exact_match"}, port=self.ports["W"])

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def _engine(self, name: str, model_json: Path) -> ServerProcess:
        launch = LaunchConfig(
            model_path="random",
            port=self.ports[name],
            module="megatron_earl.rollout.serve.server",
            extra_args=("--model-config", str(model_json), "--max-seq-len", "256",
                        "--max-batch-size", "16", "--pace-decode-ms", str(PACE_MS)),
        )  # fmt: skip
        return ServerProcess(launch, log_path=str(self.tmp / f"{name}.log"), env=ENV)

    def _relay(self, name: str) -> RelayProcess:
        upstreams = {"R0": (), "R1": ("R0",), "R2": ("R1", "R0")}[name]
        engines = {"R0": (), "R1": ("e0", "e1"), "R2": ("e2",)}[name]
        launch = RelayLaunch(
            self.ports[name],
            upstreams=tuple(self.url(u) for u in upstreams),
            engines=tuple(self.url(e) for e in engines),
            extra_args=RELAY_ARGS,
        )
        return RelayProcess(launch, log_path=str(self.tmp / f"{name}.log"), env=ENV)

    def pid(self, name: str) -> int:
        if name == "W":
            return self.reward.proc.pid
        return (self.engines.get(name) or self.relays[name]).process.pid

    def kill(self, name: str) -> None:
        if name == "W":
            self.reward.proc.kill()
            self.reward.proc.wait()
        else:
            (self.engines.get(name) or self.relays[name]).kill()

    def restart(self, name: str) -> None:
        if name == "W":
            self.reward = self._reward()
        elif name in self.engines:
            self.engines[name] = self._engine(name, self._model_json)
            self.engines[name].wait_healthy(timeout_s=180)
        else:
            self.relays[name] = self._relay(name)
            self.relays[name].wait_healthy(timeout_s=60, path="/health")

    def stop(self) -> None:
        procs = [*self.relays.values(), *self.engines.values()]
        for p in procs:
            if p.process.poll() is None:
                os.kill(p.process.pid, signal.SIGCONT)
        stop_all(procs, stop_timeout_s=10)
        if self.reward is not None:
            self.reward.stop()


def inject(cluster: Cluster, fault: Fault, down_s: float) -> None:
    """The fault, for ``down_s`` seconds; returns when it has ended (restart done/SIGCONT)."""
    if fault.kind in ("kill-engine", "kill-relay", "kill-reward"):
        cluster.kill(fault.target)
        time.sleep(down_s)
        cluster.restart(fault.target)
    elif fault.kind in ("stall-engine", "slow-relay"):
        os.kill(cluster.pid(fault.target), signal.SIGSTOP)
        time.sleep(down_s)
        os.kill(cluster.pid(fault.target), signal.SIGCONT)
    else:
        raise ValueError(f"unknown fault kind {fault.kind!r}")


def newest_published(cluster: Cluster) -> tuple[int | None, int | None]:
    """(version, publisher generation) of R0's newest version."""

    async def get():
        async with aiohttp.ClientSession() as s:
            async with s.get(cluster.url("R0") + "/relay_info") as resp:
                info = await resp.json()
                return info["newest_version"], info["newest_generation"]

    return asyncio.run(get())


def all_current(cluster: Cluster, after_generation: int | None = None) -> bool:
    """Every engine answers and reports R0's newest version (published by a generation newer
    than ``after_generation``, when given)."""
    newest, generation = newest_published(cluster)
    if after_generation is not None and (generation is None or generation <= after_generation):
        return False

    async def versions():
        clients = [SGLangClient(cluster.url(e), ClientConfig(max_retries=0, control_timeout_s=2))
                   for e in cluster.engines]  # fmt: skip
        try:
            out = await asyncio.gather(
                *(c.get_model_info() for c in clients), return_exceptions=True
            )
            return [None if isinstance(o, BaseException) else c.weight_version
                    for c, o in zip(clients, out)]  # fmt: skip
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    return newest is not None and all(v == newest for v in asyncio.run(versions()))


def _steps_done(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.strip())


def run_suite(
    work: Path, down_s: float, health_s: float, faults=FAULTS, every: int = EVERY
) -> dict:
    """The whole suite (module docstring); returns the report dict. ``every``: steps between
    faults at least (more: the run outlasts slow restarts on a loaded machine)."""
    work.mkdir(parents=True, exist_ok=True)
    steps = every * len(faults) + 1
    overrides = [*RUN, f"steps={steps}", f"rollout.sglang.health_interval_s={health_s}"]
    model = load_config(CONFIG, [*overrides, "rollout.sglang.weight_update=tensor"]).model
    model_json = work / "model.json"
    model_json.write_text(json.dumps(model.to_dict()))
    cluster = Cluster(work)
    results: list[FaultResult] = []
    try:
        cluster.start(model_json)
        engines = ",".join(cluster.url(e) for e in ("e0", "e1", "e2"))
        cmd = [
            sys.executable, "-m", "megatron_earl.cli.main", "train", "--nproc", "2",
            "--config", str(CONFIG), *overrides, f"output_dir={work}", "name=faults",
            f"rollout.engine_urls=[{engines}]", f"rollout.sglang.relay_urls=[{cluster.url('R0')}]",
            f"reward.service_url={cluster.url('W')}", "reward.fns=[exact]", "reward.weights=[0.1]",
            "reward.retries=6",
        ]  # fmt: skip
        metrics = work / "faults" / "metrics.jsonl"
        log = open(work / "trainer.log", "w")

        def launch() -> subprocess.Popen:
            env = {**os.environ, **ENV}
            return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)

        trainer = launch()
        start = time.monotonic()
        try:
            for i, fault in enumerate(faults):
                k = 1 + every * i
                while _steps_done(metrics) < k:
                    if trainer.poll() is not None:
                        raise RuntimeError(f"trainer exited ({trainer.returncode}) before step {k}")
                    time.sleep(0.1)
                done = _steps_done(metrics)
                result = FaultResult(fault.kind, fault.target, done, time.monotonic() - start)
                generation = None
                if fault.kind == "kill-trainer":
                    generation = newest_published(cluster)[1]
                    trainer.kill()  # SIGKILL; its ranks die with it (PR_SET_PDEATHSIG)
                    trainer.wait()
                    result.served_while_down = _serve_while(cluster, down_s)
                    trainer = launch()  # resumes from the newest checkpoint, republishes
                else:
                    inject(cluster, fault, down_s)
                result.ended_s = time.monotonic() - start
                deadline = time.monotonic() + 180
                while time.monotonic() < deadline:
                    if all_current(cluster, generation) and _healthy(cluster.url("W")):
                        result.recovered_s = time.monotonic() - start - result.ended_s
                        break
                    if trainer.poll() not in (None, 0):  # crashed: nothing will republish
                        break
                    time.sleep(0.1)
                results.append(result)
            code = trainer.wait(timeout=900)
        finally:
            if trainer.poll() is None:
                trainer.kill()
            log.close()
        relay_info = {n: _relay_info(cluster.url(n)) for n in cluster.relays}
    finally:
        cluster.stop()
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return report_dict(code, records, results, relay_info, steps, down_s, health_s)


def _serve_while(cluster: Cluster, seconds: float) -> bool:
    """Whether every engine answers ``/health`` at every check for ``seconds``."""
    deadline, ok = time.monotonic() + seconds, True
    while time.monotonic() < deadline:
        ok = ok and all(_healthy(cluster.url(e)) for e in cluster.engines)
        time.sleep(0.25)
    return ok


def _healthy(url: str) -> bool:
    async def get():
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url + "/health") as resp:
            return resp.status == 200

    try:
        return asyncio.run(get())
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def _relay_info(url: str) -> dict:
    async def get():
        async with aiohttp.ClientSession() as s, s.get(url + "/relay_info") as resp:
            return await resp.json()

    try:
        return asyncio.run(get())
    except aiohttp.ClientError as err:
        return {"error": str(err)}


def accounting(records: list[dict]) -> list[dict]:
    """Per step: lost (produced - consumed - discarded - buffered), trained twice (consumed -
    steps x groups, counted from the run's start or its resume: a resumed run's producers count
    from zero, seen as a drop of the consumed count) and the step's trajectories against groups
    x samples."""
    rows = []
    base, before = 0, 0.0
    for step, r in enumerate(records, start=1):
        c = {
            k: r[f"rollout/async_{k}_groups"]
            for k in ("produced", "consumed", "discarded", "buffered")
        }
        resumed = c["consumed"] < before  # the first step of a resumed run
        if resumed:
            base = step - 1
        before = c["consumed"]
        rows.append({
            "step": step,
            "resumed": resumed,
            "lost_groups": c["produced"] - c["consumed"] - c["discarded"] - c["buffered"],
            "trained_twice_groups": c["consumed"] - (step - base) * GROUPS,
            "trajectories": r["rollout/trajectories"],
            "discarded_groups": c["discarded"],
        })  # fmt: skip
    return rows


def report_dict(code, records, results, relay_info, steps, down_s, health_s) -> dict:
    rows = accounting(records)
    faulted = {f.after_step + 1 for f in results}
    step_s = [r["time/step"] for r in records]
    clean = [s for i, s in enumerate(step_s, start=1) if i not in faulted and i > 1]
    # a resumed run's counters start from zero: add each run's last record (the steps a killed
    # run did after its checkpoint are redone and their records dropped, so this is a lower bound)
    ends = [i - 2 for i, r in enumerate(rows, start=1) if r["resumed"]] + [len(records) - 1]

    def total(key: str) -> float | None:
        values = [records[i].get(key) for i in ends if i >= 0]
        return None if not values or None in values else sum(values)

    return {
        "returncode": code,
        "steps_completed": len(records),
        "steps": steps,
        "down_s": down_s,
        "health_interval_s": health_s,
        "lost_groups": sum(r["lost_groups"] for r in rows),
        "trained_twice_groups": sum(abs(r["trained_twice_groups"]) for r in rows),
        "short_steps": [r["step"] for r in rows if r["trajectories"] != GROUPS * SAMPLES],
        "resumed_at_steps": [r["step"] for r in rows if r["resumed"]],
        "discarded_groups": total("rollout/async_discarded_groups"),
        "engine_failovers": total("rollout/async_engine_failovers"),
        "moved_from_stalled": total("rollout/async_moved_from_stalled"),
        "failed_trajectories": sum(r.get("rollout/failed", 0) for r in records),
        "median_clean_step_s": statistics.median(clean) if clean else None,
        "faults": [
            {**f.to_dict(), "step_s": step_s[f.after_step] if f.after_step < len(step_s) else None}
            for f in results
        ],
        "relays": {n: i.get("counters", i) for n, i in relay_info.items()},
        "accounting": rows,
    }


def report(out: dict) -> str:
    served = [f["served_while_down"] for f in out["faults"] if f["kind"] == "kill-trainer"]
    lines = [
        f"bench faults: {out['steps_completed']}/{out['steps']} steps (exit {out['returncode']}),"
        f" faults of {out['down_s']:g} s, health checks every {out['health_interval_s']:g} s",
        f"lost groups {out['lost_groups']}, trained twice {out['trained_twice_groups']}, steps "
        f"short of trajectories {out['short_steps']}, discarded (stale) {out['discarded_groups']}",
        f"engine failovers {out['engine_failovers']}, requests moved off a stalled engine "
        f"{out['moved_from_stalled']}, median fault-free step {out['median_clean_step_s']:.2f} s",
        f"resumed runs began at steps {out['resumed_at_steps']} (kill-trainer: engines served "
        f"throughout: {served})",
        "back s: from the injection until the component ran again (restart or SIGCONT); "
        "recovered s: from then until every engine serves the newest version and the reward "
        "service answers; step s: the step the fault began in",
        f"{'fault':<14} {'target':<6} {'after step':>10} {'step s':>7} {'back s':>7} "
        f"{'recovered s':>12}",
    ]
    for f in out["faults"]:
        rec = "never" if f["recovered_s"] is None else f"{f['recovered_s']:.2f}"
        step = "-" if f["step_s"] is None else f"{f['step_s']:.2f}"
        back = f["ended_s"] - f["injected_s"]
        lines.append(
            f"{f['kind']:<14} {f['target']:<6} {f['after_step']:>10} {step:>7} {back:>7.2f} "
            f"{rec:>12}"
        )
    for name, c in out["relays"].items():
        lines.append(f"relay {name}: {c}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="megatron-earl bench faults", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--down-s", type=float, default=4.0)
    p.add_argument("--health-s", type=float, default=1.0)
    p.add_argument(
        "--work", default=None, help="directory for logs and the run (default: a temp dir)"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.down_s <= 0 or args.health_s <= 0:
        p.error(f"--down-s and --health-s must be > 0, got {args.down_s}, {args.health_s}")
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-faults-"))
    out = run_suite(work, args.down_s, args.health_s)
    print(report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ok = out["returncode"] == 0 and out["lost_groups"] == 0 and out["trained_twice_groups"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
