"""Benchmark: `megatron-earl serve` under concurrent load -- request latency p50/p99, throughput,
lost requests -- for one or more source trees (e.g. before/after an engine change).

    megatron-earl bench serve                                   # this checkout
    git worktree add /tmp/earl-before 817722f
    megatron-earl bench serve --sources /tmp/earl-before,.      # the same load on both, in turn

For each source directory a `serve` process is started from that tree (``PYTHONPATH=<dir>``,
``python -m megatron_earl.cli.main serve``) on the demo model (the ``model:`` section of
``--config``, random weights of ``--seed``), ``--max-batch-size`` rows; ``--concurrency``
clients then send ``--requests`` requests in all over HTTP (each client one request at a time;
``/generate`` with ``input_ids`` of ``--prompt-len`` random tokens, ``max_new_tokens``
``--new-tokens``, temperature 1, no stop), after ``--warmup`` untimed requests. Latency is
per request (send to full response); a request is lost when it does not come back 200 with
exactly ``--new-tokens`` output ids. Printed per source: p50, p99, mean latency, requests/s,
output tokens/s, lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from megatron_earl.bench.engine import DEMO_CONFIG, demo_model


@dataclass(frozen=True)
class ServeLoad:
    """The load one serve process gets."""

    concurrency: int = 32
    """Clients sending at the same time (each one request at a time)."""
    requests: int = 256
    """Timed requests in all."""
    warmup: int = 32
    """Untimed requests first."""
    prompt_len: int = 32
    """Random prompt tokens per request."""
    new_tokens: int = 48
    """Tokens generated per request (no stop)."""
    max_batch_size: int = 32
    """Rows of the engine (``serve --max-batch-size``)."""
    seed: int = 0
    """Weights and prompts."""

    def __post_init__(self) -> None:
        bad = {k: v for k, v in asdict(self).items() if k != "seed" and v < 1}
        if bad:
            raise ValueError(f"these values must be >= 1: {bad}")


@dataclass(frozen=True)
class ServeResult:
    source: str
    p50_s: float
    p99_s: float
    mean_s: float
    requests_per_s: float
    tokens_per_s: float
    lost: int


async def _drive(
    url: str, load: ServeLoad, vocab: int, count: int
) -> tuple[list[float], int, float]:
    """Send ``count`` requests from ``load.concurrency`` clients; (latencies, lost, wall)."""
    import random

    rng = random.Random(load.seed)
    prompts = [[rng.randrange(vocab) for _ in range(load.prompt_len)] for _ in range(count)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []
    lost = 0
    params = {"max_new_tokens": load.new_tokens, "temperature": 1.0}

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal lost
        while not queue.empty():
            ids = queue.get_nowait()
            start = time.perf_counter()
            try:
                async with session.post(
                    f"{url}/generate", json={"input_ids": ids, "sampling_params": params}
                ) as resp:
                    body = await resp.json()
                    ok = resp.status == 200 and len(body["output_ids"]) == load.new_tokens
            except (aiohttp.ClientError, KeyError, TypeError, ValueError):
                ok = False
            if ok:
                latencies.append(time.perf_counter() - start)
            else:
                lost += 1

    timeout = aiohttp.ClientTimeout(total=600)
    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(load.concurrency)))
    return latencies, lost, time.perf_counter() - start


async def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with code {proc.returncode} before it was ready")
            try:
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"serve at {url} not healthy after {timeout_s:.0f} s")


def quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values (nearest rank; NaN when empty)."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(source: str, load: ServeLoad, model_json: Path, port: int) -> ServeResult:
    """Start serve from ``source``, run the load, stop it."""
    env = {**os.environ, "PYTHONPATH": str(Path(source).resolve())}
    cmd = [
        sys.executable, "-m", "megatron_earl.cli.main", "serve", "--port", str(port),
        "--model-config", str(model_json), "--seed", str(load.seed),
        "--max-batch-size", str(load.max_batch_size),
        "--max-seq-len", str(load.prompt_len + load.new_tokens),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, cwd=source, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_ready(url, proc))
        vocab = json.loads(model_json.read_text())["vocab_size"]
        asyncio.run(_drive(url, load, vocab, load.warmup))
        latencies, lost, wall = asyncio.run(_drive(url, load, vocab, load.requests))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    latencies.sort()
    done = len(latencies)
    return ServeResult(
        source=source,
        p50_s=quantile(latencies, 0.50),
        p99_s=quantile(latencies, 0.99),
        mean_s=statistics.fmean(latencies) if done else float("nan"),
        requests_per_s=done / wall,
        tokens_per_s=done * load.new_tokens / wall,
        lost=lost,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sources", default=".", help="comma-separated source trees, run in turn")
    p.add_argument("--config", default=str(DEMO_CONFIG), help="run config whose model: is used")
    p.add_argument("--port", type=int, default=30171)
    for field, default in asdict(ServeLoad()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    args = p.parse_args(argv)
    load = ServeLoad(**{f: getattr(args, f) for f in asdict(ServeLoad())})
    model = demo_model(args.config, [])
    with tempfile.TemporaryDirectory() as tmp:
        model_json = Path(tmp) / "model.json"
        model_json.write_text(json.dumps(model.to_dict()))
        results = [measure(s, load, model_json, args.port) for s in args.sources.split(",")]
    print(
        f"bench serve: {load.concurrency} concurrent clients, {load.requests} requests "
        f"(+{load.warmup} warm-up), prompt {load.prompt_len}, {load.new_tokens} new tokens, "
        f"temperature 1, engine rows {load.max_batch_size}, demo model, 1 serve process "
        f"(torch threads: all {os.cpu_count()} cores)"
    )
    print(f"{'source':>28} {'p50 s':>7} {'p99 s':>7} {'mean s':>7} {'req/s':>7} {'tok/s':>8} lost")
    for r in results:
        print(
            f"{r.source[-28:]:>28} {r.p50_s:>7.3f} {r.p99_s:>7.3f} {r.mean_s:>7.3f} "
            f"{r.requests_per_s:>7.1f} {r.tokens_per_s:>8.0f} {r.lost:>4}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
