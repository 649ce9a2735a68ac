"""``megatron-earl serve``'s colocation endpoints over HTTP (the real server app, engine and model
in one process, driven by ``SGLangClient`` and raw requests): releasing every tag frees the KV
cache tensors (garbage-collected) and empties the parameters (values in the host backup), bytes
reported by ``/get_server_info``; ``/generate`` answers 503 while anything is released; bad tags,
double release/resume, a weight update into released weights and a release of a busy engine are
400s naming the problem; resume in SGLang users' order (weights, then kv_cache + cuda_graph)
gives the same greedy tokens and log-probs as before; a request queued while paused before the
release completes after the resume."""

from __future__ import annotations

from megatron_earl.testing.distributed import run_distributed

GEN = {
    "input_ids": [5, 17, 99, 3, 42, 7],
    "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
    "return_logprob": True,
}


def _memory_cycle() -> dict:
    import asyncio
    import gc
    import weakref

    import torch
    from aiohttp.test_utils import TestClient, TestServer

    from megatron_earl.rollout.engine import GenerateRequest, SamplingParams
    from megatron_earl.rollout.serve.server import Server, build_engine, parse_args
    from megatron_earl.rollout.sglang.client import (
        ClientConfig,
        EngineRequestError,
        SGLangClient,
    )
    from megatron_earl.rollout.weights.sync import serialize_named_tensors

    engine, model = build_engine(parse_args(["--seed", "0", "--max-seq-len", "128"]))
    server = Server(engine, "random")
    out: dict = {}

    async def main() -> None:
        await engine.start()
        http = TestClient(TestServer(server.app()))
        await http.start_server()
        client = SGLangClient(str(http.make_url("")), ClientConfig(max_retries=0))

        async def post(path: str, body: dict) -> tuple[int, object]:
            resp = await http.post(path, json=body)
            return resp.status, await resp.json()

        async def info() -> dict:
            return await (await http.get("/get_server_info")).json()

        async def refused(call) -> str:
            try:
                await call
            except EngineRequestError as err:
                return f"{err.status} {err}"
            return "accepted"

        try:
            out["before"] = (await post("/generate", GEN))[1]
            out["info_before"] = await info()
            cache = weakref.ref(engine._forward.cache.keys[0])
            param = next(engine.model.parameters())
            out["bad_tag"] = await post("/release_memory_occupation", {"tags": ["kv", "weights"]})
            out["bad_field"] = (await post("/release_memory_occupation", {"tag": None}))[0]

            await client.release_memory_occupation()  # every tag
            gc.collect()
            out["info_released"] = await info()
            out["cache_freed"] = cache() is None
            out["param_numel"] = param.numel()
            out["generate_released"] = await post("/generate", GEN)
            out["health_generate"] = (await http.get("/health_generate")).status
            out["double_release"] = await refused(client.release_memory_occupation(["kv_cache"]))
            payload = serialize_named_tensors(
                [("model.norm.weight", torch.full((model.hidden_size,), 2.0))]
            )
            await client.begin_weight_update()
            out["update_released"] = await post(
                "/update_weights_from_tensor", {"serialized_named_tensors": [payload]}
            )
            await client.end_weight_update()

            await client.resume_memory_occupation(["weights"])  # SGLang users' order
            out["info_weights"] = await info()
            out["generate_kv_released"] = (await post("/generate", GEN))[0]
            out["double_resume"] = await refused(client.resume_memory_occupation(["weights"]))
            await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
            out["info_resumed"] = await info()
            out["after"] = (await post("/generate", GEN))[1]

            # A running request makes the engine busy: release refused, nothing released.
            long = GenerateRequest(tuple(range(1, 9)), SamplingParams(max_new_tokens=100))
            task = asyncio.ensure_future(engine.generate(long))
            while not engine.num_running:
                await asyncio.sleep(0.001)
            await client.pause("in_place")
            out["busy"] = await refused(client.release_memory_occupation())
            out["busy_released"] = list(engine.released)
            # Retracted while paused: it waits through the release and finishes after resume.
            await client.pause("retract")
            await client.release_memory_occupation()
            await client.resume()
            await asyncio.sleep(0.05)
            out["queued_done_while_released"] = task.done()
            await client.resume_memory_occupation()
            out["queued"] = len((await asyncio.wait_for(task, 60)).output_ids)
        finally:
            await client.close()
            await http.close()
            await engine.shutdown()

    asyncio.run(main())
    return out


def test_release_frees_memory_and_resume_restores_the_same_outputs():
    out = run_distributed(_memory_cycle, 1, timeout_s=180)[0]
    before, released = out["info_before"], out["info_released"]
    assert before["released_memory"] == [] and before["weight_backup_bytes"] == 0
    assert before["kv_cache_bytes"] > 0 and before["weight_bytes"] > 0

    status, body = out["bad_tag"]
    message = body["error"]["message"]
    assert status == 400 and "['kv']" in message
    assert "kv_cache, weights, cuda_graph" in message
    assert out["bad_field"] == 400

    assert released["released_memory"] == ["kv_cache", "weights", "cuda_graph"]
    assert released["kv_cache_bytes"] == 0 and released["weight_bytes"] == 0
    assert released["weight_backup_bytes"] == before["weight_bytes"]
    assert out["cache_freed"] and out["param_numel"] == 0
    status, body = out["generate_released"]
    assert status == 503 and "resume_memory_occupation" in body["error"]["message"]
    assert out["health_generate"] == 200
    assert out["double_release"].startswith("400") and "already released" in out["double_release"]
    status, body = out["update_released"]
    assert status == 400 and "weights are released" in body["error"]["message"]

    weights = out["info_weights"]
    assert weights["released_memory"] == ["kv_cache", "cuda_graph"]
    assert weights["weight_bytes"] == before["weight_bytes"] and weights["kv_cache_bytes"] == 0
    assert out["generate_kv_released"] == 503
    assert out["double_resume"].startswith("400") and "not released" in out["double_resume"]
    resumed = out["info_resumed"]
    assert resumed["released_memory"] == []
    assert resumed["kv_cache_bytes"] == before["kv_cache_bytes"]
    assert resumed["weight_bytes"] == before["weight_bytes"]
    assert resumed["weight_backup_bytes"] == 0
    # The weights came back with their values: the same greedy tokens and log-probs.
    assert out["after"]["output_ids"] == out["before"]["output_ids"]
    assert (
        out["after"]["meta_info"]["output_token_logprobs"]
        == (out["before"]["meta_info"]["output_token_logprobs"])
    )

    assert out["busy"].startswith("400") and "idle" in out["busy"]
    assert out["busy_released"] == []
    assert not out["queued_done_while_released"] and out["queued"] == 100
