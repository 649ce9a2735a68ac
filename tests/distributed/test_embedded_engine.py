"""The embedded engine against references computed without a KV cache.

* Greedy generation of concurrent requests (different prompt lengths, more requests than slots,
  so requests join a running batch; the cache shifts right for a longer prompt and compacts left
  at the context limit) equals a plain full-recompute greedy decode of the same weights, token for
  token, at TP1 and TP2 (reference: TP1, single process).
* The engine's rollout log-probs equal the training side's (``forward_backward`` + ``lm_loss`` on
  the same tokens, same layout) within the fp32 bound of a forward's sums in another order
  (``tests/tolerances.py``: ~2e-4 x |log-prob|; observed ~3e-7 x).
* Seeded sampling is reproducible and top_k=1 equals greedy.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import assert_fp32_close, gpt_terms

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=250,
    make_vocab_size_divisible_by=64,
    add_qkv_bias=True,
    init_method_std=0.1,
)
PROMPT_LENS = (5, 17, 9, 23, 3, 12)
MAX_NEW = (12, 8, 16, 10, 14, 9)
MAX_SEQ = 40
LOGPROB_TERMS = gpt_terms(MODEL, MAX_SEQ)
"""A log-prob's chain of fp32 sums (the KV-cache decode orders them otherwise than one forward of
the whole sequence, and a batch of rows otherwise than one row): ~1.7e3 terms. A cache row or
position off moves log-probs by O(1)."""


def _prompts() -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(7)
    return [
        tuple(torch.randint(0, MODEL.vocab_size, (n,), generator=gen).tolist()) for n in PROMPT_LENS
    ]


def _build(layout: ParallelLayout, weights, model: ModelConfig = MODEL):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import full_state_dict, load_full_state_dict

    initialize_layout(layout)
    runtime.seed(1234)
    chunks = build_model(model)
    if weights is None:
        weights = full_state_dict(chunks)
    load_full_state_dict(chunks, weights)
    return chunks, weights


def _reference(prompts, max_new, model: ModelConfig = MODEL):
    """Full-recompute greedy decode (no cache) at TP1; returns the weights and token lists."""
    chunks, weights = _build(ParallelLayout(), None, model)
    gpt = chunks[0].eval()
    outputs = []
    with torch.no_grad():
        for prompt, n_new in zip(prompts, max_new):
            seq = list(prompt)
            for _ in range(n_new):
                tokens = torch.tensor([seq])
                logits = gpt(tokens, torch.arange(len(seq))[None], None)
                seq.append(int(torch.argmax(logits[0, -1, : model.vocab_size])))
            outputs.append(seq[len(prompt) :])
    return weights, outputs


def _train_logprobs(chunks, prompt, output, vocab_size: int = MODEL.vocab_size):
    """The trainer's log-probs of ``output``: normalised over the real vocabulary, as the RL
    loss computes them (``head_logprobs`` with ``vocab_size``)."""
    from megatron_earl.training.schedule import forward_backward, token_logprobs

    def loss_fn(logits, batch):
        logprobs = token_logprobs(logits, batch["labels"], vocab_size)
        return logits.new_zeros(()), {"logprobs": logprobs.detach()}

    seq = torch.tensor([list(prompt) + list(output)])
    batch = {
        "tokens": seq[:, :-1],
        "labels": seq[:, 1:],
        "position_ids": torch.arange(seq.size(1) - 1)[None],
        "loss_mask": torch.ones(1, seq.size(1) - 1),
    }
    metrics = forward_backward(chunks, [batch], loss_fn, forward_only=True)
    return metrics[0]["logprobs"][0, len(prompt) - 1 :]


def _engine_run(layout, weights, prompts, max_new, model: ModelConfig = MODEL):
    """Engine outputs (scheduler rank), then training log-probs of them on every TP rank."""
    import torch.distributed as dist

    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    chunks, _ = _build(layout, weights, model)
    engine = EmbeddedEngine(
        chunks, model, EmbeddedEngineConfig(max_batch_size=3, max_seq_len=MAX_SEQ)
    )

    async def driver(eng):
        import asyncio

        greedy = [
            GenerateRequest(p, SamplingParams(max_new_tokens=n, temperature=0.0))
            for p, n in zip(prompts, max_new)
        ]
        results = await asyncio.gather(*(eng.generate(r) for r in greedy))
        sampled = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=5)
        again = [await eng.generate(GenerateRequest(prompts[0], sampled)) for _ in range(2)]
        top1 = await eng.generate(
            GenerateRequest(prompts[1], SamplingParams(max_new_tokens=8, top_k=1, seed=1))
        )
        return results, again, top1

    out = run_engine(engine, driver)
    # Every TP rank needs the sampled outputs for the (TP-parallel) training forward.
    box = [out]
    dist.broadcast_object_list(box, src=0)
    results, again, top1 = box[0]
    train = [_train_logprobs(chunks, p, r.output_ids) for p, r in zip(prompts, results)]
    return results, again, top1, train


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, 1, args=(_prompts(), MAX_NEW), timeout_s=120)[0]


@pytest.mark.parametrize("layout", [ParallelLayout(), ParallelLayout(tp=2)], ids=str)
def test_greedy_equals_full_recompute_and_logprobs_match_training(reference, layout):
    weights, expected = reference
    world = layout.tp
    out = run_distributed(
        _engine_run, world, args=(layout, weights, _prompts(), MAX_NEW), timeout_s=180
    )[0]
    results, again, top1, train = out
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        assert list(res.output_ids) == exp, f"request {i}: {res.output_ids} != {exp}"
        assert res.finish_reason.type.value == "length"
        assert res.prompt_tokens == PROMPT_LENS[i]
        assert_fp32_close(torch.tensor(res.output_logprobs), train[i], LOGPROB_TERMS)
    assert again[0].output_ids == again[1].output_ids  # same seed, same tokens
    assert list(top1.output_ids) == expected[1][:8]  # top_k=1 is greedy


def _mixed_requests(prompts, stop_id):
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.engine import GenerateRequest

    settings = [
        SamplingParams(max_new_tokens=12, temperature=0.0),
        SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop_id,)),
        SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_new_tokens=10, temperature=1.3, top_k=5, seed=4),
        SamplingParams(max_new_tokens=14, temperature=0.0),
        SamplingParams(max_new_tokens=9, temperature=0.6, seed=5),
    ]
    return [GenerateRequest(p, s) for p, s in zip(prompts, settings, strict=True)]


def _mixed_run(layout, weights, prompts, stop_id, step_thread=True):
    """The same requests one at a time, then all at once through 3 KV rows (the rest wait);
    and this rank's torch threads after ``run_engine`` (2 before it; decode steps run on 1, on
    this thread on a TP follower and without a step thread)."""
    import asyncio

    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )

    torch.set_num_threads(2)
    chunks, _ = _build(layout, weights)
    config = EmbeddedEngineConfig(
        max_batch_size=3, max_seq_len=MAX_SEQ, max_prefill_tokens=30, step_thread=step_thread
    )
    engine = EmbeddedEngine(chunks, MODEL, config)
    requests = _mixed_requests(prompts, stop_id)

    async def driver(eng):
        alone = [await eng.generate(r) for r in requests]
        running: list[int] = []
        tasks = [asyncio.ensure_future(eng.generate(r)) for r in requests]
        while not all(t.done() for t in tasks):
            running.append(eng.num_running)
            await asyncio.sleep(0)
        return alone, [t.result() for t in tasks], max(running)

    out = run_engine(engine, driver)
    return out, torch.get_num_threads()


@pytest.mark.parametrize(
    "layout, step_thread",
    [(ParallelLayout(), True), (ParallelLayout(tp=2), True), (ParallelLayout(), False)],
    ids=["tp1", "tp2", "tp1-steps-on-loop-thread"],
)
def test_mixed_batch_equals_one_request_at_a_time(reference, layout, step_thread):
    """Mixed prompt lengths, stop ids, max_new_tokens and sampling settings in one batch: every
    request gets exactly what it gets alone (greedy and seeded sampling, token for token); a
    batch over the KV budget (3 rows for 6 requests) waits, nothing fails. Steps in the worker
    thread or on the event loop's thread (``bench engine``); every rank's thread gets its torch
    thread count back when the engine stops."""
    weights, expected = reference
    stop_id = expected[1][3]  # request 1 stops at its 4th greedy token
    args = (layout, weights, _prompts(), stop_id, step_thread)
    ranks = run_distributed(_mixed_run, layout.tp, args=args, timeout_s=180)
    assert [threads for _, threads in ranks] == [2] * layout.tp  # the follower's too
    alone, together, max_running = ranks[0][0]
    assert max_running <= 3
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert b.output_ids == a.output_ids, f"request {i}: {b.output_ids} != {a.output_ids}"
        assert b.finish_reason == a.finish_reason, i
        got, want = torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs)
        assert_fp32_close(got, want, LOGPROB_TERMS)
    assert list(alone[0].output_ids) == expected[0]  # greedy, alone = full recompute
    assert alone[1].finish_reason.type.value == "stop" and alone[1].output_ids[-1] == stop_id
    assert len(alone[1].output_ids) <= 4


def _sharing_run(weights, prompts, step_thread):
    """A GRPO group (identical prompts) in one batch, and a second turn that takes over its
    session's parked row, each next to the same work without sharing."""
    import asyncio

    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    chunks, _ = _build(ParallelLayout(), weights)
    config = EmbeddedEngineConfig(max_batch_size=6, max_seq_len=40, step_thread=step_thread)
    engine = EmbeddedEngine(chunks, MODEL, config)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def driver(eng):
        group = await asyncio.gather(
            *(eng.generate(GenerateRequest(prompts[2], greedy)) for _ in range(4))
        )
        first = await eng.generate(GenerateRequest(prompts[0], greedy, session="s"))
        turn2 = prompts[0] + first.output_ids + (7, 8, 9)
        reused = await eng.generate(GenerateRequest(turn2, greedy, session="s"))
        fresh = await eng.generate(GenerateRequest(turn2, greedy))
        # A one-token prompt joining a running request is a prefill, not a decode step.
        longer = SamplingParams(max_new_tokens=12, temperature=0.0)
        running = asyncio.ensure_future(eng.generate(GenerateRequest(prompts[1], longer)))
        while eng.num_running == 0:  # admitted (prefilled): it holds row 0
            await asyncio.sleep(0.001)
        tiny = await eng.generate(GenerateRequest((5,), greedy))
        await running
        # Weights loaded while a session's request runs: its row is not parked for reuse.
        task = asyncio.ensure_future(eng.generate(GenerateRequest(prompts[0], longer, session="w")))
        while eng.num_running == 0:  # prefilled with version 0's weights
            await asyncio.sleep(0.001)
        await eng.pause("in_place")  # the request keeps its row across the update
        await eng.load_state_dict(weights, version=7)
        await eng.resume()
        before = await task
        after = await eng.generate(
            GenerateRequest(prompts[0] + before.output_ids + (7,), greedy, session="w")
        )
        return group, first, reused, fresh, tiny, after

    return run_engine(engine, driver)


@pytest.mark.parametrize("step_thread", [True, False], ids=["step-thread", "loop-thread"])
def test_shared_prefill_and_session_reuse_change_nothing(reference, step_thread):
    """Also with pause, weight load and resume between steps, in either thread."""
    weights, expected = reference
    group, first, reused, fresh, tiny, after = run_distributed(
        _sharing_run, 1, args=(weights, _prompts(), step_thread), timeout_s=120
    )[0]
    assert len(tiny.output_ids) == 6
    assert after.cached_tokens == 0 and after.weight_version == 7
    assert all(list(r.output_ids) == expected[2][:6] for r in group)
    for r in group:  # the rows decode in one batch: equal up to float summation order
        want = torch.tensor(group[0].output_logprobs)
        assert_fp32_close(torch.tensor(r.output_logprobs), want, LOGPROB_TERMS)
    assert list(first.output_ids) == expected[0][:6]
    # The parked row holds prompt + 5 outputs (the 6th was sampled, never fed back).
    assert reused.cached_tokens == len(_prompts()[0]) + 5 and fresh.cached_tokens == 0
    assert reused.output_ids == fresh.output_ids
    want = torch.tensor(fresh.output_logprobs)
    assert_fp32_close(torch.tensor(reused.output_logprobs), want, LOGPROB_TERMS)


QWEN3_LIKE = dataclasses.replace(MODEL, add_qkv_bias=False, qk_layernorm=True, tie_embeddings=True)
"""q/k layernorm and tied embeddings: the other branches of the engine's forward."""


def test_qk_layernorm_and_tied_embeddings_equal_full_recompute():
    prompts, max_new = _prompts()[:3], MAX_NEW[:3]
    weights, expected = run_distributed(
        _reference, 1, args=(prompts, max_new, QWEN3_LIKE), timeout_s=120
    )[0]
    layout = ParallelLayout(tp=2)
    results, _, _, train = run_distributed(
        _engine_run, 2, args=(layout, weights, prompts, max_new, QWEN3_LIKE), timeout_s=180
    )[0]
    for res, exp, lp in zip(results, expected, train, strict=True):
        assert list(res.output_ids) == exp
        assert_fp32_close(torch.tensor(res.output_logprobs), lp, gpt_terms(QWEN3_LIKE, MAX_SEQ))


QWEN3_MOE_LIKE = dataclasses.replace(
    QWEN3_LIKE,
    tie_embeddings=False,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    sequence_parallel=True,  # megatron-core's MoE at tp > 1; a no-op at tp = 1
)
"""A Qwen3-MoE-shaped model: the engine runs megatron-core's own ``MoELayer`` per layer."""


@pytest.mark.parametrize("layout", [ParallelLayout(), ParallelLayout(tp=2)], ids=str)
def test_mixture_of_experts_equals_full_recompute_and_training(layout):
    """Greedy tokens equal the no-cache TP1 forward's token for token (the router sees the same
    hidden states up to fp32 sums in another order; a top-2 choice would flip only on a gap below
    that bound, which these random weights do not have: the same tokens on every run), and the
    rollout log-probs equal the training forward's within the fp32 bound of its sums."""
    prompts, max_new = _prompts()[:3], MAX_NEW[:3]
    weights, expected = run_distributed(
        _reference, 1, args=(prompts, max_new, QWEN3_MOE_LIKE), timeout_s=120
    )[0]
    results, again, _, train = run_distributed(
        _engine_run, layout.tp, args=(layout, weights, prompts, max_new, QWEN3_MOE_LIKE),
        timeout_s=180,
    )[0]  # fmt: skip
    for res, exp, lp in zip(results, expected, train, strict=True):
        assert list(res.output_ids) == exp
        assert_fp32_close(torch.tensor(res.output_logprobs), lp, gpt_terms(QWEN3_MOE_LIKE, MAX_SEQ))
    assert again[0].output_ids == again[1].output_ids  # seeded sampling through the router


ROPE_PROMPT_LENS = (13, 21, 9)
"""Longer than the tiny models' original context (8 positions) once generation runs."""


def _hf_greedy(hf_dir: str, prompts, max_new) -> list[list[int]]:
    """``transformers``' greedy tokens (full recompute per token, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt, n_new in zip(prompts, max_new, strict=True):
            seq = list(prompt)
            for _ in range(n_new):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            outputs.append(seq[len(prompt) :])
    return outputs


def _hf_engine_run(hf_dirs: dict[str, str], prompts, max_new):
    """For each HF directory: its model config (``families``), weights loaded from the directory,
    the embedded engine's greedy tokens (one rank)."""
    from megatron_earl import runtime
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.convert.families import model_config_from_hf, read_hf_config
    from megatron_earl.convert.initial import load_initial_weights
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    initialize_layout(ParallelLayout())
    out = {}
    for name, hf_dir in hf_dirs.items():
        model = model_config_from_hf(read_hf_config(hf_dir), make_vocab_size_divisible_by=16)
        runtime.seed(1)
        chunks = build_model(model)
        load_initial_weights(chunks, hf_dir)
        engine = EmbeddedEngine(
            chunks, model, EmbeddedEngineConfig(max_batch_size=2, max_seq_len=MAX_SEQ)
        )

        async def driver(eng):
            import asyncio

            requests = [
                GenerateRequest(p, SamplingParams(max_new_tokens=n, temperature=0.0))
                for p, n in zip(prompts, max_new)
            ]
            return await asyncio.gather(*(eng.generate(r) for r in requests))

        out[name] = [list(r.output_ids) for r in run_engine(engine, driver)]
    return out


@pytest.mark.parametrize("rope", ["llama3", "yarn"])
def test_rope_scaled_hf_model_generates_what_transformers_generates(tmp_path, rope):
    """A Llama-3-scaled (tied, as Llama 3.2 1B/3B) and a YaRN tiny HF model: the embedded engine,
    built from the converted config and loaded from the HF directory, generates transformers'
    greedy tokens past the original context."""
    from megatron_earl.convert.tiny import save_tiny_hf

    hf_dir = str(save_tiny_hf("llama", tmp_path / rope, tie=rope == "llama3", rope=rope))
    gen = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(0, 100, (n,), generator=gen).tolist()) for n in ROPE_PROMPT_LENS]
    max_new = (12, 10, 14)
    expected = _hf_greedy(hf_dir, prompts, max_new)
    got = run_distributed(_hf_engine_run, 1, args=({rope: hf_dir}, prompts, max_new))[0]
    assert got[rope] == expected
    assert len({t for out in expected for t in out}) > 3  # not one repeated token


ROUTE_GAP = 1e-4
"""A route may differ from the full forward's only where that forward's k-th and (k+1)-th router
logits are closer than this: the engine's hidden states equal it up to fp32 sums in another
order (~1e-6 here), so a choice flips only on such a near-tie."""


def _routes_run(layout, weights, prompts, model: ModelConfig):
    """Two turns per prompt on an engine that records routes (the second turn on the first's
    parked row, asking for the routes from where the first turn's stopped); every rank returns
    the scheduler's results."""
    import asyncio

    import torch.distributed as dist

    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    chunks, _ = _build(layout, weights, model)
    # 4 rows: each of the 3 sessions finds a free row to park in when its first turn ends
    config = EmbeddedEngineConfig(max_batch_size=4, max_seq_len=MAX_SEQ, record_routes=True)
    engine = EmbeddedEngine(chunks, model, config)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def driver(eng):
        asks = [
            GenerateRequest(p, greedy, session=f"s{i}", return_routed_experts=True)
            for i, p in enumerate(prompts)
        ]
        first = await asyncio.gather(*(eng.generate(r) for r in asks))
        second = []
        for i, (p, r) in enumerate(zip(prompts, first)):
            context = (*p, *r.output_ids, 7, 9)
            held = len(p) + len(r.output_ids) - 1
            request = GenerateRequest(
                context, greedy, session=f"s{i}", return_routed_experts=True,
                routed_experts_start_len=held,
            )  # fmt: skip
            second.append(await eng.generate(request))
        return first, second

    box = [run_engine(engine, driver)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _reference_routes(weights, seqs, model: ModelConfig):
    """TP1 full forwards of ``seqs``: per sequence its routes ``[n, L, k]`` and, per (position,
    layer), the gap between the k-th and (k+1)-th router logits."""
    from megatron_earl.models.routing import moe_routers, recording

    chunks, _ = _build(ParallelLayout(), weights, model)
    gpt = chunks[0].eval()
    routers = moe_routers(chunks)
    inputs = []
    hooks = [
        layer.mlp.router.register_forward_hook(lambda m, args, out: inputs.append((m, args[0])))
        for layer in gpt.decoder.layers
    ]
    out = []
    with torch.no_grad():
        for seq in seqs:
            inputs.clear()
            with recording(routers) as routes:
                gpt(torch.tensor([seq]), torch.arange(len(seq))[None], None)
                recorded = routes()
            logits = torch.stack([r.gating(x.view(-1, x.size(-1))) for r, x in inputs], dim=1)
            top = logits.topk(model.moe_router_topk + 1, dim=-1).values
            out.append((recorded, top[..., -2] - top[..., -1]))
    for hook in hooks:
        hook.remove()
    return out


@pytest.mark.parametrize("layout", [ParallelLayout(), ParallelLayout(tp=2)], ids=str)
def test_recorded_routes_equal_the_full_forwards_through_a_cached_prefix(layout):
    """The routes a request gets back (``return_routed_experts``) are the full forward's at
    every computed position, the first turn's from position 0 and the second turn's -- served
    from the first's parked row -- from ``routed_experts_start_len``, its cached prefix
    included; the rows are positions ``[start, n - 1)`` as SGLang returns them."""
    from megatron_earl.models.routing import disagreement

    prompts = _prompts()[:3]
    weights, _ = run_distributed(
        _reference, 1, args=(prompts, (1, 1, 1), QWEN3_MOE_LIKE), timeout_s=120
    )[0]
    first, second = run_distributed(
        _routes_run, layout.tp, args=(layout, weights, prompts, QWEN3_MOE_LIKE), timeout_s=180
    )[0]
    seqs = [(*p, *a.output_ids, 7, 9, *b.output_ids) for p, a, b in zip(prompts, first, second)]
    reference = run_distributed(
        _reference_routes, 1, args=(weights, seqs, QWEN3_MOE_LIKE), timeout_s=120
    )[0]
    layers, topk = QWEN3_MOE_LIKE.num_layers, QWEN3_MOE_LIKE.moe_router_topk
    for p, a, b, seq, (routes, gap) in zip(prompts, first, second, seqs, reference, strict=True):
        n_first = len(p) + len(a.output_ids)
        assert a.routed_experts.shape == (n_first - 1, layers, topk)
        assert a.routed_experts.dtype == torch.int32
        assert b.cached_tokens > 0  # the second turn ran on the parked row
        assert b.routed_experts.shape == (len(seq) - 1 - (n_first - 1), layers, topk)
        got = torch.cat([a.routed_experts, b.routed_experts])
        differs = disagreement(got.long(), routes[: len(seq) - 1])
        assert not bool((differs & (gap[: len(seq) - 1] > ROUTE_GAP)).any()), differs.nonzero()
