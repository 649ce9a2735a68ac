"""A stateless reward service over HTTP (aiohttp), run as a separate process, and its client.

Server (one process, any number of named reward functions, each ``f(input: dict) -> float``,
sync or async, given as registered names or dotted paths):

    python -m megatron_earl.rewards.service --port 8700 --fn exact=exact_match \\
        --fn judge=my_pkg.rewards:judge

    POST /reward  {"fn": "exact", "input": <RewardInput.to_dict()>}  -> {"reward": 1.0}
    GET  /health                                                    -> {"ok": true, "fns": [...]}

Errors: unknown fn, bad body (not JSON, or nested deeper than the parser follows) or a badly
shaped input (not an object, a ``RewardInput`` field of the wrong type: ``input_problem``; an
input the function declares it cannot score: ``RewardInputError``, e.g. ``exact_match`` on a
non-numeric ``task.target``) -> 400 (deterministic: not retried); the function raising anything
else (``SystemExit`` included: the service goes on) or returning a non-finite/non-number -> 500
(retried). With ``$EARL_REWARD_API_KEY`` set on the service (and on the trainer, whose client
sends it) every request but ``GET``/``HEAD /health``, whatever its method, needs
``Authorization: Bearer KEY``.

Synchronous functions run on a bounded pool of worker threads (``--threads``,
``compat.user_threads``), so a slow one does not block the other clients; a call that
never returns holds its thread. ``launch_reward_service`` starts the process and waits
for its ready line. The client ``RemoteReward`` is a ``RewardFn`` with a per-request timeout and
retries with exponential backoff on connection errors, timeouts and 5xx answers.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from megatron_earl.compat.http_guard import bearer_matches, parse_json, route_path
from megatron_earl.compat.user_threads import MAX_USER_THREADS, UserThreads, call_user
from megatron_earl.envs.tool_env import last_number
from megatron_earl.rewards.base import RewardInput, WeightedReward
from megatron_earl.tools.registry import Registry

REWARD_FNS: Registry[Callable[[dict[str, Any]], float]] = Registry("reward function")
"""Registry of server-side reward functions (input dict -> float)."""
READY = "REWARD_SERVICE_READY"
API_KEY_ENV = "EARL_REWARD_API_KEY"
"""Environment variable with the service's API key (``Authorization: Bearer``); unset: none."""


class RewardInputError(ValueError):
    """Raised by a reward function for an input it cannot score (the request's error: 400, not
    retried); the message names the value."""


@REWARD_FNS.register("exact_match")
def exact_match(inp: dict[str, Any]) -> float:
    """1 when the last number of the last model turn equals ``task["target"]`` (a number or a
    numeric string; anything else is a ``RewardInputError``)."""
    turns, target = inp.get("turns") or [], inp.get("task", {}).get("target")
    if not turns or target is None:
        return 0.0
    try:
        wanted = float(target)
    except (TypeError, ValueError):
        raise RewardInputError(
            f"exact_match needs input.task.target to be a number or a numeric string, got "
            f"{target!r:.80}"
        ) from None
    value = last_number(turns[-1])
    return float(value is not None and value == wanted)


INPUT_TYPES: dict[str, tuple[type, ...]] = {
    "uid": (str,),
    "seed": (int,),
    "task": (dict,),
    "turns": (list,),
    "outcome": (int, float),
    "end_reason": (str,),
    "extra": (dict,),
}
"""JSON types of the ``RewardInput`` fields an input may carry (every one optional)."""


def input_problem(inp: Any) -> str | None:
    """Why ``inp`` is not a ``RewardInput``-shaped object (None when it is): a JSON object whose
    present fields have their types, ``turns`` a list of strings, ``outcome`` finite. A badly
    shaped input is the client's deterministic error (400), not the function's (500)."""
    if not isinstance(inp, dict):
        return f"'input' must be an object (RewardInput fields), got {type(inp).__name__}"
    for name, types in INPUT_TYPES.items():
        if name not in inp:
            continue
        value = inp[name]
        if isinstance(value, bool) or not isinstance(value, types):
            want = " or ".join(t.__name__ for t in types)
            return f"input.{name} must be {want}, got {value!r:.80}"
    if not all(isinstance(t, str) for t in inp.get("turns", [])):
        return "input.turns must be a list of strings (one per model turn)"
    if not math.isfinite(inp.get("outcome", 0.0)):
        return f"input.outcome must be finite, got {inp['outcome']}"
    return None


def build_app(
    fns: dict[str, Callable[[dict[str, Any]], Any]],
    threads: UserThreads | None = None,
    api_key: str | None = None,
) -> web.Application:
    """The aiohttp application serving ``fns`` by name; synchronous functions run on
    ``threads`` (default the process's ``USER_THREADS``), never on the event loop. With
    ``api_key`` every request but ``GET /health`` needs it."""

    @web.middleware
    async def keyed(request: web.Request, handler):
        header = request.headers.get("Authorization")
        if api_key and route_path(request) != "/health" and not bearer_matches(header, api_key):
            return web.json_response(
                {"error": f"missing or wrong Authorization: Bearer <{API_KEY_ENV}>"}, status=401
            )
        return await handler(request)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "fns": sorted(fns)})

    async def reward(request: web.Request) -> web.Response:
        try:
            body = parse_json(await request.read(), "the request")
            fn = fns[body["fn"]]
            inp = body["input"]
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response(
                {
                    "error": f"bad request ({type(e).__name__}: {e}); body must be "
                    f"{{'fn': one of {sorted(fns)}, 'input': {{...}}}}"
                },
                status=400,
            )
        problem = input_problem(inp)
        if problem is not None:
            return web.json_response({"error": f"bad request: {problem}"}, status=400)
        try:
            value = float(await call_user(fn, inp, threads=threads))
            if not math.isfinite(value):
                raise ValueError(f"non-finite reward {value}")
        except RewardInputError as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        except (Exception, SystemExit, KeyboardInterrupt) as e:  # the service goes on
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)
        return web.json_response({"reward": value})

    app = web.Application(middlewares=[keyed])
    app.router.add_get("/health", health)
    app.router.add_post("/reward", reward)
    return app


class RewardServiceError(RuntimeError):
    """The reward service did not give a reward (after retries, or a 4xx answer)."""


class RemoteReward:
    """A ``RewardFn`` computed by the reward service (timeout + retry with backoff)."""

    def __init__(
        self,
        url: str,
        fn: str,
        name: str | None = None,
        timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.2,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(
                f"need timeout_s > 0, retries >= 0, backoff_s >= 0; got "
                f"{timeout_s}, {retries}, {backoff_s}"
            )
        self.url, self.fn, self.name = url.rstrip("/"), fn, name or fn
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.num_retries = 0
        """Retries made so far (a metric)."""

    async def __call__(self, inp: RewardInput | dict[str, Any]) -> float:
        payload = {"fn": self.fn, "input": inp.to_dict() if isinstance(inp, RewardInput) else inp}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        last = ""
        async with aiohttp.ClientSession(timeout=timeout, headers=_auth_headers()) as session:
            for attempt in range(self.retries + 1):
                if attempt:
                    self.num_retries += 1
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    async with session.post(f"{self.url}/reward", json=payload) as resp:
                        body = await resp.json(content_type=None)
                        if resp.status == 200:
                            return float(body["reward"])
                        last = f"HTTP {resp.status}: {body.get('error')}"
                        if resp.status < 500:
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                    last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise RewardServiceError(
            f"reward {self.fn!r} at {self.url} failed after {attempt + 1} attempt(s): {last}"
        )


def remote_rewards(config) -> list[WeightedReward]:
    """The run's remote reward functions (``RunConfig.reward``: a ``RewardConfig``), weighted,
    for the agent loop; empty without a service."""
    if not config.service_url:
        return []
    return [
        WeightedReward(
            RemoteReward(
                config.service_url, fn, timeout_s=config.timeout_s, retries=config.retries
            ),
            weight,
        )
        for fn, weight in config.weighted()
    ]


async def check_reward_service(config) -> None:
    """Raise ``RewardServiceError`` unless the service answers ``/health`` and serves every
    function of ``config.fns`` (start-up: before any rollout). No-op without a service."""
    if not config.service_url:
        return
    url = f"{config.service_url.rstrip('/')}/health"
    try:
        timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url) as resp:
                body = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise RewardServiceError(
            f"reward service not reachable at start-up (GET {url}): {type(e).__name__}: {e}; "
            "check reward.service_url and that the service is up"
        ) from None
    missing = sorted(set(config.fns) - set(body.get("fns", [])))
    if missing:
        raise RewardServiceError(
            f"reward.fns {missing} are not served by {config.service_url} (it serves "
            f"{body.get('fns')}); start it with --fn NAME=FN for each"
        )


class RewardServiceProcess:
    """A reward service running in a child process."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> RewardServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_reward_service(
    fns: dict[str, str], port: int = 0, timeout_s: float = 60.0
) -> RewardServiceProcess:
    """Start ``python -m megatron_earl.rewards.service`` serving ``{name: fn spec}``; returns
    when it is listening (port 0 = any free port)."""
    cmd = [sys.executable, "-m", "megatron_earl.rewards.service", "--port", str(port)]
    for name, spec in fns.items():
        cmd += ["--fn", f"{name}={spec}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(READY):
            return RewardServiceProcess(proc, int(line.split("port=")[1]))
        if not line and proc.poll() is not None:
            raise RewardServiceError(f"reward service exited with {proc.returncode}: {cmd}")
    proc.kill()
    raise RewardServiceError(f"reward service not ready within {timeout_s}s: {cmd}")


def _auth_headers() -> dict[str, str]:
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


async def serve(fns: dict[str, str], host: str, port: int, threads: int = MAX_USER_THREADS) -> None:
    resolved = {name: REWARD_FNS.resolve(spec) for name, spec in fns.items()}
    key = os.environ.get(API_KEY_ENV) or None
    app = build_app(resolved, UserThreads(threads, name="earl-reward"), api_key=key)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.create_server((host, port))  # bound here so port 0 yields the real port
    await web.SockSite(runner, sock).start()
    print(f"{READY} port={sock.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Stateless reward service (HTTP).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument(
        "--fn",
        action="append",
        default=[],
        help="NAME=SPEC: a registered reward fn or a dotted path",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=MAX_USER_THREADS,
        help="worker threads for synchronous reward functions (a call past the client's "
        "timeout keeps its thread until it returns)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    fns = dict(f.split("=", 1) for f in args.fn) or {"exact_match": "exact_match"}
    asyncio.run(serve(fns, args.host, args.port, args.threads))


if __name__ == "__main__":
    from megatron_earl.compat.processes import skip_exit_gc

    skip_exit_gc()
    main()
