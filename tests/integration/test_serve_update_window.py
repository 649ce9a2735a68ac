"""``megatron-earl serve`` during a weight update: a generation request that arrives while the
update is applied waits for it (as SGLang holds requests behind its model-update lock; a 503
here made SGLang's router open its circuit breaker on an engine that was only updating) and is
then served with the new weights. The engine's weight load is held on an event so the window is
deterministic; everything else (HTTP server, engine, model) is real."""

from __future__ import annotations

from megatron_earl.testing.distributed import run_distributed


def _update_window() -> dict:
    import asyncio

    import torch
    from aiohttp.test_utils import TestClient, TestServer

    from megatron_earl.rollout.serve.server import Server, build_engine, parse_args
    from megatron_earl.rollout.weights.sync import serialize_named_tensors

    engine, model = build_engine(parse_args(["--seed", "0", "--max-seq-len", "64"]))
    server = Server(engine, "random")
    out: dict = {}

    async def main() -> None:
        await engine.start()
        release, started = asyncio.Event(), asyncio.Event()
        original = engine.load_state_dict

        async def held_load(full, version):
            started.set()
            await release.wait()
            await original(full, version)

        engine.load_state_dict = held_load
        client = TestClient(TestServer(server.app()))
        await client.start_server()
        try:
            gen = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
            out["before"] = (await client.post("/generate", json=gen)).status
            payload = serialize_named_tensors(
                [("model.norm.weight", torch.full((model.hidden_size,), 2.0))]
            )
            assert (await client.post("/begin_weight_update", json={})).status == 200
            update = asyncio.create_task(
                client.post(
                    "/update_weights_from_tensor",
                    json={"serialized_named_tensors": [payload], "weight_version": "7"},
                )
            )
            await started.wait()
            during = asyncio.create_task(client.post("/generate", json=gen))
            await asyncio.sleep(0.3)
            out["held"] = not during.done()
            release.set()
            out["update"] = (await update).status
            assert (await client.post("/end_weight_update", json={})).status == 200
            answer = await during
            out["during"] = (answer.status, (await answer.json())["meta_info"]["weight_version"])
            out["after"] = (await client.post("/generate", json=gen)).status
            out["version"] = engine.weight_version
        finally:
            await client.close()
            await engine.shutdown()

    asyncio.run(main())
    return out


def test_generate_during_weight_update_waits_for_it_then_serves_the_new_weights():
    out = run_distributed(_update_window, 1, timeout_s=120)[0]
    assert out["before"] == 200
    assert out["held"]
    assert out["during"] == (200, "7")
    assert out["update"] == 200 and out["version"] == 7
    assert out["after"] == 200
