"""The SGLang client and pool drive two ``megatron-earl serve`` processes started by the SGLang
launcher's code path (``module=megatron_earl.rollout.serve.server``): generate, weight push (outputs
change, version increments, both servers agree), pause/continue, abort, bad input (4xx with a
message, the server keeps serving), and a killed server whose in-flight requests are retried on
the other one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
import torch
import yarl

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.engine import FinishType, GenerateRequest
from megatron_earl.rollout.sglang.client import ClientConfig, EngineRequestError, SGLangClient
from megatron_earl.rollout.sglang.launcher import (
    LaunchConfig,
    ServerProcess,
    build_command,
    stop_all,
)
from megatron_earl.rollout.sglang.pool import EnginePool
from megatron_earl.testing.distributed import free_port

API_KEY = "test-key"
MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=256,
    make_vocab_size_divisible_by=64,
)
MAX_SEQ = 96
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
PROMPT = (5, 17, 99, 3, 42, 7)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    config_path = tmp / "model.json"
    config_path.write_text(json.dumps(MODEL.to_dict()))
    procs = []
    for i in range(2):
        launch = LaunchConfig(
            model_path="random",
            port=free_port(),
            api_key=API_KEY,
            module="megatron_earl.rollout.serve.server",
            extra_args=(
                "--model-config",
                str(config_path),
                "--seed",
                "3",
                "--max-seq-len",
                str(MAX_SEQ),
                "--max-batch-size",
                "4",
                "--body-timeout",
                "2",
                "--max-queued-requests",
                "64",
            ),
        )
        procs.append(
            ServerProcess(
                launch,
                log_path=str(tmp / f"server{i}.log"),
                env={"OMP_NUM_THREADS": "1"},
                rebind_on_conflict=True,
            )
        )
    try:
        for proc in procs:
            proc.wait_healthy(timeout_s=120)
        yield procs
    finally:
        assert None not in stop_all(procs, stop_timeout_s=20)


def _client(proc: ServerProcess, **kw) -> SGLangClient:
    return SGLangClient(proc.url, ClientConfig(api_key=API_KEY, backoff_s=0.05, **kw))


def test_launcher_command():
    cmd = build_command(
        LaunchConfig(
            model_path="/m",
            port=1234,
            tp_size=2,
            api_key="k",
            mem_fraction_static=0.7,
            enable_memory_saver=True,
        )
    )
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[3:] == [
        "--model-path",
        "/m",
        "--tp-size",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        "1234",
        "--mem-fraction-static",
        "0.7",
        "--enable-memory-saver",
        "--api-key",
        "k",
        "--skip-server-warmup",
    ]


def test_generate_and_weight_update(servers):
    from megatron_earl.models.hf_mapping import global_shapes
    from megatron_earl.rollout.weights.sync import WeightSyncConfig, hf_named_tensors, push_weights

    async def body():
        a, b = _client(servers[0]), _client(servers[1])
        first = await a.generate(GenerateRequest(PROMPT, GREEDY))
        assert len(first.output_ids) == 12 and len(first.output_logprobs) == 12
        assert first.finish_reason.type is FinishType.LENGTH
        assert all(lp <= 0 for lp in first.output_logprobs)
        assert first.prompt_tokens == len(PROMPT) and first.weight_version == 0
        same = await b.generate(GenerateRequest(PROMPT, GREEDY))
        assert same.output_ids == first.output_ids  # same seed, same weights
        gen = torch.Generator().manual_seed(11)
        full = {k: torch.randn(s, generator=gen) * 0.3 for k, s in global_shapes(MODEL).items()}
        stats = await push_weights(
            [a, b], hf_named_tensors(full, MODEL), 1, WeightSyncConfig(bucket_bytes=64 << 10)
        )
        assert stats.num_buckets > 1
        after_a = await a.generate(GenerateRequest(PROMPT, GREEDY))
        after_b = await b.generate(GenerateRequest(PROMPT, GREEDY))
        assert after_a.output_ids != first.output_ids  # weights visibly changed
        assert after_a.output_ids == after_b.output_ids
        assert after_a.weight_version == 1
        assert (await a.get_model_info())["weight_version"] == "1"
        await a.close()
        await b.close()

    asyncio.run(body())


def test_a_push_reads_its_tensors_one_bucket_ahead_of_the_send(servers):
    """``push_weights`` streams: when bucket k goes out, the tensors read from the source are
    those of buckets 0 .. k + 1 (the look-ahead that marks the last bucket) and one more tensor
    (the one that closes bucket k + 1), never the model:
    the trainer stages bucket by bucket (``orchestration.engines.sglang.staged_weights``)."""
    import itertools

    from megatron_earl.models.hf_mapping import global_shapes
    from megatron_earl.rollout.weights.sync import (
        WeightSyncConfig,
        hf_named_tensors,
        iter_buckets,
        push_weights,
    )

    bucket_bytes = 32 << 10
    gen = torch.Generator().manual_seed(12)
    full = {k: torch.randn(s, generator=gen) * 0.3 for k, s in global_shapes(MODEL).items()}
    named = list(hf_named_tensors(full, MODEL))
    sizes = [sum(t.nbytes for _, t in b) for b in iter_buckets(named, bucket_bytes)]
    ends = list(itertools.accumulate(sizes))  # bytes of buckets 0 .. k
    read = 0
    read_at_send: list[int] = []

    def source():
        nonlocal read
        for name, tensor in named:
            read += tensor.nbytes
            yield name, tensor

    async def body():
        client = _client(servers[0])
        send = client.update_weights_from_tensor

        async def counted(payloads, **kw):
            read_at_send.append(read)
            return await send(payloads, **kw)

        client.update_weights_from_tensor = counted
        try:
            return await push_weights(
                [client], source(), 2, WeightSyncConfig(bucket_bytes=bucket_bytes)
            )
        finally:
            await client.close()

    stats = asyncio.run(body())
    assert stats.num_buckets == len(sizes) == len(read_at_send) > 3
    largest = max(t.nbytes for _, t in named)
    for k, seen in enumerate(read_at_send):
        # buckets 0 .. k + 1, and the tensor that told the bucketing bucket k + 1 was full
        assert seen <= ends[min(k + 1, len(ends) - 1)] + largest, (k, read_at_send, ends)
    assert read_at_send[0] < ends[-1]  # the first bucket left before the model was read


def test_pause_continue_and_abort(servers):
    async def body():
        a = _client(servers[0])
        await a.pause("in_place")
        task = asyncio.create_task(a.generate(GenerateRequest(PROMPT, GREEDY, rid="r-paused")))
        doomed = asyncio.create_task(a.generate(GenerateRequest(PROMPT, GREEDY, rid="r-abort")))
        await asyncio.sleep(0.5)
        assert not task.done() and not doomed.done()
        await a.abort("r-abort")
        aborted = await asyncio.wait_for(doomed, 10)
        assert aborted.finish_reason.type is FinishType.ABORT and aborted.output_ids == ()
        await a.resume()
        done = await asyncio.wait_for(task, 30)
        assert done.finish_reason.type is FinishType.LENGTH and len(done.output_ids) == 12
        await a.close()

    asyncio.run(body())


def test_bad_input_gets_4xx_and_server_keeps_serving(servers):
    url = servers[1].url

    async def post(session, path, data, auth=True):
        headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
        async with session.post(url + path, data=data, headers=headers) as resp:
            return resp.status, await resp.text()

    async def body():
        async with aiohttp.ClientSession() as s:
            cases = [
                ("/generate", "{not json", "malformed JSON"),
                ("/generate", json.dumps({"input_ids": [1], "bogus": 1}), "unknown field"),
                ("/generate", json.dumps({"input_ids": [1, 999]}), "outside the vocabulary"),
                (
                    "/generate",
                    json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 500}}),
                    "context limit",
                ),
                (
                    "/generate",
                    json.dumps({"input_ids": [1], "sampling_params": {"top_p": 2}}),
                    "top_p",
                ),
                (
                    "/update_weights_from_tensor",
                    json.dumps({"serialized_named_tensors": ["@@"]}),
                    "base64",
                ),
            ]
            assert (await post(s, "/begin_weight_update", "{}"))[0] == 200
            for path, data, needle in cases:
                status, text = await post(s, path, data)
                assert status == 400 and needle in text, (path, status, text)
            assert (await post(s, "/end_weight_update", "{}"))[0] == 200
            status, text = await post(s, "/pause_generation", "{}", auth=False)
            assert status == 401 and "Bearer" in text
        client = _client(servers[1])
        with pytest.raises(EngineRequestError, match="outside the vocabulary"):
            await client.generate(GenerateRequest((1, 300), GREEDY))
        ok = await client.generate(GenerateRequest(PROMPT, GREEDY))
        assert len(ok.output_ids) == 12
        await client.close()

    asyncio.run(body())


def test_killed_server_requests_fail_over(servers):
    async def body():
        a, b = _client(servers[0], max_retries=2), _client(servers[1], max_retries=2)
        pool = EnginePool([a, b])
        await a.pause("in_place")  # requests routed to A wait there until it dies
        params = SamplingParams(max_new_tokens=8, temperature=0.0)
        tasks = [
            asyncio.create_task(pool.generate(GenerateRequest(PROMPT, params, session=f"s{i}")))
            for i in range(4)
        ]
        await asyncio.sleep(0.5)
        assert pool.loads[0] > 0  # some requests are in flight on A
        servers[0].kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(len(r.output_ids) == 8 for r in results)
        assert pool.failovers >= 1 and pool.healthy == [False, True]
        assert await pool.check_health() == [False, True]
        await pool.close()

    asyncio.run(body())


# Values that pass a naive validation and used to break the engine loop for good (issue 22,
# item 2): each must get a 400 naming the field while a request in flight and the next one are
# served and /health stays 200.
LOOP_BREAKERS = {
    "temperature NaN": ('{"temperature": NaN}', "temperature must be a finite number"),
    "temperature inf": ('{"temperature": Infinity}', "temperature must be a finite number"),
    "top_p NaN": ('{"top_p": NaN}', "top_p must be a finite number"),
    "stop of ints": ('{"stop": [1, 2]}', "stop must be a list of non-empty strings"),
    "stop of a dict": ('{"stop": {"a": 1}}', "stop must be a string or a list"),
    "stop_token_ids of str": ('{"stop_token_ids": ["a"]}', "stop_token_ids must be a list"),
    "seed str": ('{"sampling_seed": "x"}', "seed must be an integer"),
    "seed float": ('{"sampling_seed": 1.5}', "seed must be an integer"),
    "max_new_tokens inf": ('{"max_new_tokens": Infinity}', "max_new_tokens must be an integer"),
    "max_new_tokens NaN": ('{"max_new_tokens": NaN}', "max_new_tokens must be an integer"),
    "top_k 1.5": ('{"top_k": 1.5}', "top_k must be an integer"),
    "min_p NaN": ('{"min_p": NaN}', "min_p must be a finite number"),
    "min_p over 1": ('{"min_p": 1.5}', "min_p must be in [0, 1]"),
    "n zero": ('{"n": 0}', "sampling_params.n=0"),
    "n str": ('{"n": "2"}', "sampling_params.n must be an integer"),
    "penalty": ('{"frequency_penalty": 0.5}', "not supported by this server"),
}


def test_loop_breaking_values_get_400_and_the_engine_keeps_serving(servers):
    url = servers[1].url
    headers = {"Authorization": f"Bearer {API_KEY}"}
    long = {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": 60, "temperature": 0}}

    async def body():
        async with aiohttp.ClientSession(headers=headers) as s:
            in_flight = asyncio.create_task(s.post(url + "/generate", json=long))
            for name, (sampling, needle) in LOOP_BREAKERS.items():
                data = '{"input_ids": [1, 2], "sampling_params": ' + sampling + "}"
                async with s.post(url + "/generate", data=data) as resp:
                    text = await resp.text()
                    assert resp.status == 400 and needle in text, (name, resp.status, text)
                async with s.get(url + "/health") as resp:
                    assert resp.status == 200, name
            for bad in (
                {"rid": {"a": 1}},
                {"text": 5, "input_ids": None},
                {"return_logprob": True, "logprob_start_len": 99},
                {"return_logprob": True, "top_logprobs_num": 10**9},
                {"top_logprobs_num": "3"},
                {"lora_path": "adapter"},
            ):
                async with s.post(url + "/generate", json={"input_ids": [1], **bad}) as resp:
                    assert resp.status == 400, (bad, await resp.text())
            async with await in_flight as resp:
                assert resp.status == 200
                assert len((await resp.json())["output_ids"]) == 60
            # Finite but extreme: 1e-300 is greedy (SGLang's rule), 1e308 and a top_k far over
            # the vocabulary sample from the whole vocabulary.
            outs = {}
            for temp, top_k in ((0.0, -1), (1e-300, -1), (1e308, 10**30)):
                sp = {"max_new_tokens": 8, "temperature": temp, "top_k": top_k}
                async with s.post(
                    url + "/generate", json={"input_ids": list(PROMPT), "sampling_params": sp}
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    outs[temp] = (await resp.json())["output_ids"]
            assert outs[1e-300] == outs[0.0] and len(outs[1e308]) == 8

    asyncio.run(body())


def test_weight_update_with_non_finite_or_misshapen_values_is_refused(servers):
    from megatron_earl.models.hf_mapping import global_shapes
    from megatron_earl.rollout.weights.sync import hf_named_tensors, serialize_named_tensors

    full = {k: torch.zeros(s) for k, s in global_shapes(MODEL).items()}
    name, tensor = next(iter(hf_named_tensors(full, MODEL)))
    cases = {
        "non-finite values": [(name, torch.full_like(tensor, float("nan")))],
        "shape": [(name, torch.zeros(3, 3))],
    }

    async def body():
        client = _client(servers[1])
        before = await client.generate(GenerateRequest(PROMPT, GREEDY))
        await client.begin_weight_update()
        async with aiohttp.ClientSession() as s:
            for needle, tensors in cases.items():
                async with s.post(
                    servers[1].url + "/update_weights_from_tensor",
                    json={"serialized_named_tensors": [serialize_named_tensors(tensors)]},
                    headers={"Authorization": f"Bearer {API_KEY}"},
                ) as resp:
                    text = await resp.text()
                    assert resp.status == 400 and needle in text, text
        await client.end_weight_update()
        after = await client.generate(GenerateRequest(PROMPT, GREEDY))
        assert after.output_ids == before.output_ids  # the served weights did not change
        await client.close()

    asyncio.run(body())


METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
SPELLINGS = (  # path spellings that must not reach /generate's handler without the key
    "/generate/",
    "//generate",
    "/GENERATE",
    "/health/../generate",
    "/health%2F..%2Fgenerate",
    "/health/%2e%2e/generate",
    "/./generate",
)


def test_every_endpoint_but_health_probes_needs_the_key(servers):
    """Every method (``OPTIONS`` included) on every route, and other spellings of a keyed path:
    401 without the key, except the open health probes. Routes are read off the server's own
    app, so a new endpoint is covered automatically."""
    from megatron_earl.rollout.serve.auth import OPEN_PREFIXES, RequestLimits
    from megatron_earl.rollout.serve.server import Server

    shell = Server.__new__(Server)  # only to list the routes: no engine behind it
    shell.limits = RequestLimits()
    registered = {(r.method, r.resource.canonical) for r in shell.app().router.routes()}
    paths = {path for _, path in registered}
    assert len(paths) > 10 and "*" not in {method for method, _ in registered}

    async def body():
        async with aiohttp.ClientSession() as s:
            for path in sorted(paths):
                for method in METHODS:
                    for headers in ({}, {"Authorization": f"Bearer {API_KEY}-wrong"}):
                        url = servers[1].url + path
                        async with s.request(method, url, headers=headers) as resp:
                            if path.startswith(OPEN_PREFIXES) and (method, path) in registered:
                                assert resp.status in (200, 503), (method, path, resp.status)
                            else:  # a keyed route, or a method the open probe does not take
                                assert resp.status == 401, (method, path, resp.status)
            for path in SPELLINGS:
                for method in METHODS:
                    url = servers[1].url + path
                    async with s.request(method, yarl.URL(url, encoded=True)) as resp:
                        assert resp.status == 401, (method, path, resp.status)
        # With the key, OPTIONS is answered with the route's methods (405, as SGLang answers it:
        # no route takes OPTIONS) and runs no handler: a released engine would answer 503 to the
        # /generate below.
        client = _client(servers[1])
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession(headers=headers) as s:
            for path in ("/release_memory_occupation", "/flush_cache", "/generate"):
                async with s.options(servers[1].url + path) as resp:
                    assert resp.status == 405, (path, resp.status)
                    assert "POST" in resp.headers["Allow"] and "*" not in resp.headers["Allow"]
        ok = await client.generate(GenerateRequest(PROMPT, GREEDY))
        assert len(ok.output_ids) == 12
        await client.close()

    asyncio.run(body())


def test_json_nested_too_deeply_gets_400_and_the_server_keeps_serving(servers):
    """100,000 levels of nesting: 400 naming the nesting (Python's parser stops at ~1,000)."""
    deep = "[" * 100_000 + "]" * 100_000

    async def body():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession(headers=headers) as s:
            for text in (deep, '{"input_ids": ' + deep + "}"):
                async with s.post(servers[1].url + "/generate", data=text) as resp:
                    assert resp.status == 400, resp.status
                    assert "nested too deeply" in (await resp.json())["error"]["message"]
        client = _client(servers[1])
        assert len((await client.generate(GenerateRequest(PROMPT, GREEDY))).output_ids) == 12
        await client.close()

    asyncio.run(body())


def test_oversized_body_gets_413_and_nothing_else_changes(servers):
    big = json.dumps({"input_ids": [1] * (9 << 20)})  # ~27 MiB > the 16 MiB default

    async def body():
        async with aiohttp.ClientSession() as s:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            async with s.post(servers[1].url + "/generate", data=big, headers=headers) as resp:
                assert resp.status == 413 and "exceeds the limit" in await resp.text()
        client = _client(servers[1])
        ok = await client.generate(GenerateRequest(PROMPT, GREEDY))
        assert len(ok.output_ids) == 12
        await client.close()

    asyncio.run(body())


def test_slow_senders_time_out_and_health_stays_up(servers):
    """Connections that never finish their body get 408 after --body-timeout (2 s here); while
    20 of them are open, /health and /generate are answered."""
    host, port = servers[1].url.removeprefix("http://").split(":")

    async def slow() -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
        )
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        return status

    async def body():
        senders = [asyncio.create_task(slow()) for _ in range(20)]
        await asyncio.sleep(0.2)
        client = _client(servers[1])
        assert await client.health()
        ok = await client.generate(GenerateRequest(PROMPT, GREEDY))
        await client.close()
        return ok, await asyncio.gather(*senders)

    start = time.monotonic()
    ok, statuses = asyncio.run(body())
    assert len(ok.output_ids) == 12
    assert all(s.startswith(b"HTTP/1.1 408") for s in statuses), statuses[:2]
    assert time.monotonic() - start < 8


def test_full_queue_gets_429_and_a_gone_client_frees_the_engine(servers):
    url = servers[1].url
    headers = {"Authorization": f"Bearer {API_KEY}"}
    many = {
        "input_ids": [[1, 2, i] for i in range(60)],
        "sampling_params": {"max_new_tokens": 90, "temperature": 0},
    }

    async def load(s) -> int:
        async with s.get(url + "/get_load") as resp:
            return (await resp.json())["num_reqs"]

    async def body():
        async with aiohttp.ClientSession(headers=headers) as s:
            too_many = {**many, "input_ids": [[1, 2]] * 65}  # over --max-queued-requests 64
            async with s.post(url + "/generate", json=too_many) as resp:
                assert resp.status == 429 and resp.headers["Retry-After"] == "1"
                assert "max-queued-requests 64" in await resp.text()
            # 60 sequences of 90 tokens, 4 at a time: seconds of work; the client goes away.
            gone = asyncio.create_task(s.post(url + "/generate", json=many))
            while await load(s) < 60:
                await asyncio.sleep(0.02)
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            start = time.monotonic()
            while await load(s) > 0:
                assert time.monotonic() - start < 3, "a gone client's requests kept running"
                await asyncio.sleep(0.05)
            short = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}
            async with s.post(url + "/generate", json=short) as resp:
                assert resp.status == 200, await resp.text()

    asyncio.run(body())


def test_payload_entries_that_are_not_strings_and_values_nested_under_the_limit_get_400(servers):
    """A dict or list as a payload entry (was 500: unhashable); a body over 1 MiB (parsed off
    the event loop, on a shallower stack) whose ``name`` is nested just under the parser's limit,
    then formatted into the error message on the loop (was 500: RecursionError)."""
    pad = " " * (1 << 20)

    async def body():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession(headers=headers) as s:
            url = servers[1].url
            async with s.post(url + "/begin_weight_update", json={}) as resp:
                assert resp.status == 200, resp.status
            for entry in ({"a": 1}, [1]):
                update = {"serialized_named_tensors": [entry]}
                async with s.post(url + "/update_weights_from_tensor", json=update) as resp:
                    assert resp.status == 400, resp.status
                    assert "base64 strings" in (await resp.json())["error"]["message"]
            async with s.post(url + "/end_weight_update", json={}) as resp:
                assert resp.status == 200, resp.status
            for depth in (900, 950, 980, 985, 987, 990, 995):
                text = '{"name": ' + "[" * depth + "]" * depth + "}" + pad
                async with s.post(url + "/get_weights_by_name", data=text) as resp:
                    assert resp.status == 400, (depth, resp.status)
        client = _client(servers[1])
        assert len((await client.generate(GenerateRequest(PROMPT, GREEDY))).output_ids) == 12
        await client.close()

    asyncio.run(body())


def test_a_weight_update_peaks_at_twice_its_body_in_memory(servers):
    """A keyed update of B bytes of JSON: serve's peak RSS grows by at most 2B (the body and its
    decoded text, then the text and the payload string it parses to; the
    string is dropped before its bytes become tensors: 1.75B, then 1.5B) plus 0.25B for allocator
    rounding. The update is refused after the whole body is decoded (a tensor name the model
    lacks), the path of an accepted one up to its apply (``scripts/bench_serve_memory.py``)."""
    from scripts.bench_serve_memory import KEY, reset_peak, rss_mib, update_body

    assert KEY != API_KEY
    body = update_body(128)
    pid = servers[1].process.pid
    reset_peak(pid)
    before = rss_mib(pid, "VmRSS")

    async def post():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession(headers=headers) as s:
            async with s.post(servers[1].url + "/begin_weight_update", json={}) as r:
                assert r.status == 200, r.status
            try:
                async with s.post(servers[1].url + "/update_weights_from_tensor", data=body) as r:
                    return r.status, await r.text()
            finally:
                async with s.post(servers[1].url + "/end_weight_update", json={}) as r:
                    assert r.status == 200, r.status

    status, text = asyncio.run(post())
    assert status == 400 and "absent.weight" in text
    grown = rss_mib(pid, "VmHWM") - before
    assert grown <= 2.25 * len(body) / 2**20, (grown, len(body) / 2**20)
