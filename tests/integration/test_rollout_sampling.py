"""The run config's ``rollout.sampling`` reaches every engine request whole (issue 43 item 4).

For each engine kind, a rollout of the demo run (``configs/demo_cpu.yaml``) with ``stop``,
``stop_token_ids``, ``seed``, ``top_k`` and ``min_p`` set: the agent loop's settings come from
``orchestration.rollout.agent_config`` as the trainer builds them, and the requests the engine
receives carry every field:

* embedded: a real ``EmbeddedEngine`` over the demo model (one gloo rank) driven by
  ``run_rollout``, the requests recorded at its ``generate``;
* sglang: ``SGLangClient`` against an aiohttp server that records the ``/generate`` bodies
  (``sampling_params``).

``seed`` is the root of the requests' seeds (one seed sent verbatim with every request would
sample the same tokens for every sample of a group): each request carries a distinct seed, and
another ``rollout.sampling.seed`` gives other seeds.

Run: python -m pytest -q tests/integration/test_rollout_sampling.py   (~15 s)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from megatron_earl.config import load_config
from megatron_earl.config.run import RunConfig
from megatron_earl.orchestration.rollout import PromptSet, agent_config
from megatron_earl.rollout.agent.loop import AgentLoop
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.testing.distributed import run_distributed
from megatron_earl.tokenizer import DemoTokenizer

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"
STOP_IDS = (7, 9)
SEEDS = (11, 12)


def run_config(seed: int) -> RunConfig:
    return load_config(
        DEMO,
        [
            "rollout.sampling.max_new_tokens=8",
            'rollout.sampling.stop=["</answer>"]',
            f"rollout.sampling.stop_token_ids=[{STOP_IDS[0]},{STOP_IDS[1]}]",
            f"rollout.sampling.seed={seed}",
            "rollout.sampling.top_k=20",
            "rollout.sampling.min_p=0.05",
        ],
    )


def rollout_of(config: RunConfig) -> tuple[PromptSet, object]:
    """Two prompts of step 0, two samples each, with the agent loop settings of that step (the
    sampling seed base as ``RLLoop.run_step`` computes it)."""
    prompts = PromptSet(config.env.spec(), (0, 1), "s0")
    agent = agent_config(
        config,
        group_size=2,
        temperature=config.rollout.sampling.temperature,
        seed=config.seed * 1_000_003,
    )
    return prompts, agent


def dropped(by_seed: dict[int, dict[str, dict]]) -> list[str]:
    """The configured fields the requests lack. ``by_seed[rollout.sampling.seed][rid]`` is one
    request's sampling as a dict of ``SamplingParams`` field names."""
    missing = set()
    for requests in by_seed.values():
        assert len(requests) == 4, requests  # one request per trajectory at least
        for s in requests.values():
            if tuple(s["stop"]) != ("</answer>",):
                missing.add("stop")
            if not set(STOP_IDS) <= set(s["stop_token_ids"]):
                missing.add("stop_token_ids")
            if s["top_k"] != 20:
                missing.add("top_k")
            if s["min_p"] != 0.05:
                missing.add("min_p")
        seeds = [s["seed"] for s in requests.values()]
        if None in seeds or len(set(seeds)) != len(seeds):
            missing.add("seed")
    first, second = (by_seed[s] for s in SEEDS)
    if any(first[rid]["seed"] == second.get(rid, {}).get("seed") for rid in first):
        missing.add("seed")  # the requests' seeds do not follow rollout.sampling.seed
    return sorted(missing)


def _embedded_requests() -> dict[int, dict[str, dict]]:
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.orchestration.engines.embedded import engine_config, run_rollout
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.engine import EmbeddedEngine

    layout = ParallelLayout()
    initialize_layout(layout)
    runtime.seed(3)
    tokenizer = DemoTokenizer()
    by_seed = {}
    for seed in SEEDS:
        config = run_config(seed)
        chunks = build_model(config.model)
        engine = EmbeddedEngine(
            chunks, config.model, engine_config(config, layout), detokenize=tokenizer.decode
        )
        requests = {}
        real = engine.generate

        async def recording(request, progress=None, real=real, requests=requests):
            requests[request.rid] = vars(request.sampling)
            return await real(request, progress)

        engine.generate = recording
        result = run_rollout(engine, tokenizer, *rollout_of(config))
        assert len(result.trajectories) == 4
        by_seed[seed] = requests
    return by_seed


def test_run_sampling_reaches_the_embedded_engine():
    (by_seed,) = run_distributed(_embedded_requests, 1, timeout_s=240)
    missing = dropped(by_seed)
    assert not missing, f"rollout.sampling fields dropped on the way to the engine: {missing}"


async def _sglang_requests() -> dict[int, dict[str, dict]]:
    bodies: list[dict] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, 5, None]],
        }
        return web.json_response({"text": "", "output_ids": [5], "meta_info": meta})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    by_seed = {}
    try:
        for seed in SEEDS:
            bodies.clear()
            config = run_config(seed)
            client = SGLangClient(url, ClientConfig(max_retries=0))
            prompts, agent = rollout_of(config)
            batch = await AgentLoop(client, DemoTokenizer(), agent).run_batch(
                prompts.tasks_for(0, 1)
            )
            await client.close()
            assert [t.error for t in batch.trajectories] == [None] * 4
            by_seed[seed] = {b["rid"]: _sampling_fields(b["sampling_params"]) for b in bodies}
    finally:
        await runner.cleanup()
    return by_seed


def _sampling_fields(sent: dict) -> dict:
    """SGLang's ``sampling_params`` as ``SamplingParams`` field names (absent: the default)."""
    return {
        "stop": sent.get("stop", []),
        "stop_token_ids": sent.get("stop_token_ids", []),
        "seed": sent.get("sampling_seed"),
        "top_k": sent.get("top_k", -1),
        "min_p": sent.get("min_p", 0.0),
    }


def test_run_sampling_reaches_sglang_generate():
    missing = dropped(asyncio.run(_sglang_requests()))
    assert not missing, f"rollout.sampling fields dropped on the way to /generate: {missing}"
