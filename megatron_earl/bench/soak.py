"""Benchmark: a bounded soak of `megatron-earl serve` -- normal clients and hostile-but-fair ones
at the same time for a fixed duration; every normal request must complete, every bad one must get
its 4xx, ``/health`` must answer throughout, and the server's memory must not grow without bound.

    megatron-earl bench soak                          # 60 s, 16 normal + 4 hostile clients
    megatron-earl bench soak --duration-s 600 --concurrency 32      # a longer soak by hand

One ``serve`` process (``python -m megatron_earl.cli.main serve``, this checkout) on the demo
model (the ``model:`` section of ``--config``, random weights of ``--seed``) with ``--api-key``,
``--max-body-mb 1``, ``--body-timeout`` and ``--max-queued-requests`` of the setting. Then, for
``--duration-s`` seconds:

- ``--concurrency`` normal clients, each one request at a time: ``/generate`` with
  ``--prompt-len`` random tokens, ``max_new_tokens`` ``--new-tokens``, temperature 1. A normal
  request holds when it comes back 200 with exactly that many output ids; its latency (send to
  full response) goes into p50/p99.
- ``--hostile-clients`` clients, each cycling through ``PROBES`` (the probe classes of issue 22
  items 2, 8 and 9): malformed bodies, non-finite and out-of-range sampling values, a huge
  ``max_new_tokens``, a stop list of ints, an unknown field, ids outside the vocabulary, a wrong
  key, an oversized body, more sequences than the queue takes, clients that disconnect
  mid-generation (16 long sequences, gone after 0.2 s) and mid-stream (after the first token
  event), and a slow sender that never finishes its body. A probe holds when it gets its
  expected status (a disconnect expects none: the engine must free its rows, checked at the end).
- one prober: ``/health`` every ``--health-interval-s`` (must be 200 within 5 s) and the server's
  RSS (psutil) every second.

After the duration the server must drain (``/get_load`` back to 0 within 10 s: no request of a
gone client keeps running), and its log (stderr) must hold no traceback or error line: a hostile
client is the client's problem, not a server error. Printed: the setting, normal requests (done,
failed by status, p50, p99, mean, req/s), probes (tried, held, statuses by probe), health checks
(failed, slowest), errors serve logged, RSS at start (after the warm-up), middle, end and peak,
the machine's load average before and after, and HELD or BROKE. Exit code 1 when anything
broke. Figures of a shared machine only show the method works; the lead reruns it on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil

from megatron_earl.bench.engine import DEMO_CONFIG, demo_model
from megatron_earl.bench.serve import _wait_ready, quantile

API_KEY = "soak-key"
MAX_BODY_MB = 1
HEALTH_TIMEOUT_S = 5.0
DRAIN_TIMEOUT_S = 10.0
DISCONNECTED = 0
"""The "status" of a probe whose client hangs up before any answer (the expected outcome)."""


@dataclass(frozen=True)
class SoakSetting:
    """What ``bench soak`` runs."""

    duration_s: float = 60.0
    """Seconds of load (normal and hostile clients start and stop together)."""
    concurrency: int = 16
    """Normal clients, each one request at a time."""
    hostile_clients: int = 4
    """Clients cycling through ``PROBES``, each one probe at a time."""
    prompt_len: int = 16
    """Random prompt tokens of a normal request."""
    new_tokens: int = 16
    """Tokens a normal request generates (no stop)."""
    max_batch_size: int = 8
    """Rows of the engine (``serve --max-batch-size``)."""
    max_seq_len: int = 128
    """``serve --max-seq-len``; the disconnecting client asks for nearly all of it."""
    max_queued_requests: int = 256
    """``serve --max-queued-requests``; the queue probe sends one sequence more."""
    body_timeout_s: float = 2.0
    """``serve --body-timeout``: how long a slow sender holds its connection before its 408."""
    health_interval_s: float = 0.25
    """Seconds between two ``/health`` checks."""
    seed: int = 0
    """Weights and prompts."""

    def __post_init__(self) -> None:
        positive = {k: v for k, v in asdict(self).items() if k != "seed" and not v > 0}
        if positive:
            raise ValueError(f"these values must be > 0: {positive}")
        if self.prompt_len + self.new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt_len ({self.prompt_len}) + new_tokens ({self.new_tokens}) must be <= "
                f"max_seq_len ({self.max_seq_len})"
            )


@dataclass
class SoakResult:
    """What a soak measured (``held``: nothing broke)."""

    latencies_s: list[float] = field(default_factory=list)
    """Of the normal requests that held, in completion order."""
    normal_failed: Counter = field(default_factory=Counter)
    """Normal requests that did not hold, by status (-1: no HTTP answer)."""
    probes: dict[str, Counter] = field(default_factory=dict)
    """Per probe: the statuses it got."""
    probes_broke: int = 0
    """Probes that did not get their expected status."""
    health_checks: int = 0
    health_failed: int = 0
    health_slowest_s: float = 0.0
    rss_mib: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the load started, server RSS in MiB), about once a second."""
    server_errors: list[str] = field(default_factory=list)
    """Tracebacks and error lines ``serve`` logged (a hostile client is not a server error)."""
    first_traceback: str = ""
    """The first traceback ``serve`` logged, in full (printed with the report)."""
    drained_s: float | None = None
    """Seconds until ``/get_load`` was 0 after the load stopped (None: not within 10 s)."""
    wall_s: float = 0.0
    loadavg_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loadavg_after: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def probes_tried(self) -> int:
        return sum(sum(c.values()) for c in self.probes.values())

    @property
    def held(self) -> bool:
        return (
            not self.normal_failed
            and bool(self.latencies_s)
            and self.probes_broke == 0
            and self.health_failed == 0
            and self.drained_s is not None
            and not self.server_errors
        )

    def rss_at(self, fraction: float) -> float:
        """RSS (MiB) of the sample nearest ``fraction`` of the load's duration."""
        target = fraction * self.rss_mib[-1][0]
        return min(self.rss_mib, key=lambda s: abs(s[0] - target))[1]


@dataclass(frozen=True)
class Probe:
    """One hostile-but-fair request and the status ``serve`` must answer it with."""

    name: str
    expect: int
    send: Callable[[aiohttp.ClientSession, str, SoakSetting], Awaitable[int]]


def _post(body: str | bytes, headers: dict[str, str] | None = None):
    async def send(s: aiohttp.ClientSession, url: str, setting: SoakSetting) -> int:
        async with s.post(f"{url}/generate", data=body, headers=headers) as resp:
            await resp.read()
            return resp.status

    return send


def _sampling(params: str):
    return _post('{"input_ids": [1, 2], "sampling_params": ' + params + "}")


async def _too_many(s: aiohttp.ClientSession, url: str, setting: SoakSetting) -> int:
    rows = [[1, 2]] * (setting.max_queued_requests + 1)
    body = {"input_ids": rows, "sampling_params": {"max_new_tokens": 4}}
    async with s.post(f"{url}/generate", json=body) as resp:
        await resp.read()
        return resp.status if resp.headers.get("Retry-After") else -resp.status


async def _huge(s: aiohttp.ClientSession, url: str, setting: SoakSetting) -> int:
    body = b'{"input_ids": [' + b"1, " * (MAX_BODY_MB << 19) + b"1]}"  # ~1.5 MiB
    async with s.post(f"{url}/generate", data=body) as resp:
        await resp.read()
        return resp.status


async def _disconnect(s: aiohttp.ClientSession, url: str, setting: SoakSetting) -> int:
    """16 long generations (two engine-fulls of 8 rows at least: hundreds of decode steps) whose
    client hangs up after 0.2 s; their rows must be freed (checked by the drain at the end)."""
    params = {"max_new_tokens": setting.max_seq_len - 4, "temperature": 0}
    body = {"input_ids": [[1, 2, 3, i] for i in range(16)], "sampling_params": params}
    try:
        async with asyncio.timeout(0.2), s.post(f"{url}/generate", json=body) as resp:
            await resp.read()
            return resp.status
    except TimeoutError:
        return DISCONNECTED


async def _stream_disconnect(s: aiohttp.ClientSession, url: str, setting: SoakSetting) -> int:
    """A long streamed generation whose client hangs up after its first token event."""
    params = {"max_new_tokens": setting.max_seq_len - 4, "temperature": 0}
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": params, "stream": True}
    async with s.post(f"{url}/generate", json=body) as resp:
        if resp.status != 200:
            return resp.status
        first = await resp.content.readline()
        if not first.startswith(b"data: {"):
            return -1
        resp.close()  # the connection is dropped mid-stream
    return DISCONNECTED


async def _slow_sender(s: aiohttp.ClientSession, url: str, setting: SoakSetting) -> int:
    """Headers and one byte of a 100-byte body, then nothing: must get 408 after the timeout."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
        )
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), setting.body_timeout_s + 10)
        return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else -1
    finally:
        writer.close()


PROBES = (
    Probe("malformed JSON", 400, _post("{not json")),
    Probe("body not an object", 400, _post("[1, 2]")),
    Probe("unknown field", 400, _post('{"input_ids": [1], "bogus": 1}')),
    Probe("id outside the vocabulary", 400, _post('{"input_ids": [1, 99999999]}')),
    Probe("temperature NaN", 400, _sampling('{"temperature": NaN}')),
    Probe("temperature inf", 400, _sampling('{"temperature": Infinity}')),
    Probe("top_p 2", 400, _sampling('{"top_p": 2}')),
    Probe("max_new_tokens 1e9", 400, _sampling('{"max_new_tokens": 1000000000}')),
    Probe("stop list of ints", 400, _sampling('{"stop": [1, 2]}')),
    Probe("sampling_seed 1.5", 400, _sampling('{"sampling_seed": 1.5}')),
    Probe("wrong key", 401, _post('{"input_ids": [1]}', {"Authorization": "Bearer wrong"})),
    Probe("body over --max-body-mb", 413, _huge),
    Probe("more sequences than the queue", 429, _too_many),
    Probe("client disconnects mid-generation", DISCONNECTED, _disconnect),
    Probe("client disconnects mid-stream", DISCONNECTED, _stream_disconnect),
    Probe("slow sender", 408, _slow_sender),
)


async def _soak(url: str, pid: int, setting: SoakSetting, vocab: int) -> SoakResult:
    result = SoakResult(probes={p.name: Counter() for p in PROBES})
    server = psutil.Process(pid)
    rng = random.Random(setting.seed)
    params = {"max_new_tokens": setting.new_tokens, "temperature": 1.0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    start = time.monotonic()
    end = start + setting.duration_s

    async def normal(s: aiohttp.ClientSession) -> None:
        while time.monotonic() < end:
            ids = [rng.randrange(vocab) for _ in range(setting.prompt_len)]
            sent = time.perf_counter()
            status = -1
            try:
                async with s.post(
                    f"{url}/generate", json={"input_ids": ids, "sampling_params": params}
                ) as resp:
                    status = resp.status
                    body = await resp.json()
                    if status == 200 and len(body["output_ids"]) == setting.new_tokens:
                        result.latencies_s.append(time.perf_counter() - sent)
                        continue
            except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError):
                pass
            result.normal_failed[status] += 1

    async def hostile(s: aiohttp.ClientSession, first: int) -> None:
        i = first
        while time.monotonic() < end:
            probe = PROBES[i % len(PROBES)]
            i += 1
            try:
                status = await probe.send(s, url, setting)
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
                status = -1
            result.probes[probe.name][status] += 1
            result.probes_broke += status != probe.expect

    async def prober(s: aiohttp.ClientSession) -> None:
        next_rss = time.monotonic()
        while time.monotonic() < end:
            sent = time.perf_counter()
            try:
                async with asyncio.timeout(HEALTH_TIMEOUT_S), s.get(f"{url}/health") as resp:
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            result.health_checks += 1
            result.health_failed += not ok
            result.health_slowest_s = max(result.health_slowest_s, time.perf_counter() - sent)
            if time.monotonic() >= next_rss:
                rss = server.memory_info().rss / 2**20
                result.rss_mib.append((time.monotonic() - start, rss))
                next_rss += 1.0
            await asyncio.sleep(setting.health_interval_s)
        result.rss_mib.append((time.monotonic() - start, server.memory_info().rss / 2**20))

    timeout = aiohttp.ClientTimeout(total=setting.duration_s + 120)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as s:
        tasks = [normal(s) for _ in range(setting.concurrency)]
        tasks += [hostile(s, i * 5) for i in range(setting.hostile_clients)]
        await asyncio.gather(prober(s), *tasks)
        result.wall_s = time.monotonic() - start
        stopped = time.monotonic()
        while time.monotonic() - stopped < DRAIN_TIMEOUT_S:
            async with s.get(f"{url}/get_load") as resp:
                if (await resp.json())["num_reqs"] == 0:
                    result.drained_s = time.monotonic() - stopped
                    break
            await asyncio.sleep(0.1)
    return result


def _warm_up(url: str, setting: SoakSetting) -> None:
    async def run() -> None:
        params = {"max_new_tokens": setting.new_tokens, "temperature": 1.0}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession(headers=headers) as s:
            for _ in range(2):
                body = {"input_ids": [1] * setting.prompt_len, "sampling_params": params}
                async with s.post(f"{url}/generate", json=body) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"warm-up request failed: {resp.status}")

    asyncio.run(run())


def run_soak(setting: SoakSetting, model_json: Path, port: int) -> SoakResult:
    """Start serve from this checkout, soak it, stop it."""
    source = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable, "-m", "megatron_earl.cli.main", "serve", "--port", str(port),
        "--model-config", str(model_json), "--seed", str(setting.seed),
        "--api-key", API_KEY, "--max-body-mb", str(MAX_BODY_MB),
        "--body-timeout", str(setting.body_timeout_s),
        "--max-queued-requests", str(setting.max_queued_requests),
        "--max-batch-size", str(setting.max_batch_size),
        "--max-seq-len", str(setting.max_seq_len),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(source)}
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env=env, cwd=source, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_ready(url, proc))
        _warm_up(url, setting)
        vocab = json.loads(model_json.read_text())["vocab_size"]
        before = os.getloadavg()
        result = asyncio.run(_soak(url, proc.pid, setting, vocab))
        result.loadavg_before, result.loadavg_after = before, os.getloadavg()
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with code {proc.returncode} during the soak")
        log.seek(0)
        result.server_errors, result.first_traceback = _errors(log.read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    return result


def _errors(stderr: str) -> tuple[list[str], str]:
    """The error records of serve's log (ERROR lines; each traceback as its message line and its
    exception line) and the first traceback in full (empty without one)."""
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith(("ERROR", "CRITICAL"))]
    first = ""
    for i, line in enumerate(lines):
        if not line.startswith("Traceback"):
            continue
        end = i + 1
        while end < len(lines) and lines[end][:1].isspace():
            end += 1
        raised = lines[end] if end < len(lines) else "?"
        errors.append(f"{lines[i - 1] if i else ''} -> {raised}")
        first = first or "\n".join(lines[max(i - 1, 0) : end + 1])
    return errors, first


def format_report(setting: SoakSetting, r: SoakResult) -> str:
    done, lat = len(r.latencies_s), sorted(r.latencies_s)
    failed = sum(r.normal_failed.values())
    rss0, rss_mid, rss_end = r.rss_at(0.0), r.rss_at(0.5), r.rss_at(1.0)
    peak = max(v for _, v in r.rss_mib)
    load = "/".join(f"{x:.2f}" for x in r.loadavg_before)
    load_after = "/".join(f"{x:.2f}" for x in r.loadavg_after)
    lines = [
        f"bench soak: 1 serve process, demo model, engine rows {setting.max_batch_size}, "
        f"max-seq-len {setting.max_seq_len}, max-queued-requests {setting.max_queued_requests}, "
        f"body-timeout {setting.body_timeout_s:g} s, max-body-mb {MAX_BODY_MB}; "
        f"{setting.duration_s:g} s of {setting.concurrency} normal clients (prompt "
        f"{setting.prompt_len}, {setting.new_tokens} new tokens, temperature 1) + "
        f"{setting.hostile_clients} hostile clients ({len(PROBES)} probes in turn) + /health "
        f"every {setting.health_interval_s:g} s; {os.cpu_count()} cores, load average "
        f"(1/5/15 min) {load} before, {load_after} after",
        f"normal requests: {done + failed} sent, {done} held, {failed} failed"
        f"{' ' + str(dict(r.normal_failed)) if failed else ''}; "
        f"latency p50 {quantile(lat, 0.5):.3f} s, p99 "
        f"{quantile(lat, 0.99):.3f} s, mean {statistics.fmean(lat) if lat else float('nan'):.3f}"
        f" s; {done / r.wall_s:.1f} req/s over {r.wall_s:.1f} s",
        f"hostile probes: {r.probes_tried} tried, {r.probes_tried - r.probes_broke} held, "
        f"{r.probes_broke} broke",
    ]
    for probe in PROBES:
        got = r.probes[probe.name]
        expect = "disconnect" if probe.expect == DISCONNECTED else str(probe.expect)
        statuses = ", ".join(f"{k if k else 'disconnect'}: {v}" for k, v in sorted(got.items()))
        lines.append(f"  {probe.name:>34}  expect {expect:>10}  got {{{statuses}}}")
    drained = (
        f"{r.drained_s:.2f} s" if r.drained_s is not None else f"NOT within {DRAIN_TIMEOUT_S:g} s"
    )
    lines += [
        f"/health: {r.health_checks} checks, {r.health_failed} failed, slowest "
        f"{r.health_slowest_s:.3f} s; engine drained to 0 requests {drained} after the load",
        f"serve logged {len(r.server_errors)} errors"
        + (f", e.g. {Counter(r.server_errors).most_common(1)[0]}" if r.server_errors else ""),
        f"server RSS MiB: start {rss0:.0f}, middle {rss_mid:.0f}, end {rss_end:.0f}, peak "
        f"{peak:.0f} (growth start->end {rss_end - rss0:+.0f} MiB, "
        f"{(rss_end - rss0) / rss0 * 100:+.1f}%; middle->end {rss_end - rss_mid:+.0f} MiB)",
        *([f"first traceback of serve:\n{r.first_traceback}"] if r.first_traceback else []),
        "HELD" if r.held else "BROKE",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(DEMO_CONFIG), help="run config whose model: is used")
    p.add_argument("--port", type=int, default=30181)
    for name, default in asdict(SoakSetting()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = p.parse_args(argv)
    try:
        setting = SoakSetting(**{f: getattr(args, f) for f in asdict(SoakSetting())})
    except ValueError as err:
        p.error(str(err))
    model = demo_model(args.config, [])
    with tempfile.TemporaryDirectory() as tmp:
        model_json = Path(tmp) / "model.json"
        model_json.write_text(json.dumps(model.to_dict()))
        result = run_soak(setting, model_json, args.port)
    print(format_report(setting, result), flush=True)
    return 0 if result.held else 1


if __name__ == "__main__":
    sys.exit(main())
