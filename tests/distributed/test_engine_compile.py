"""The embedded engine's compiled decode and prefill steps (``compile_decode``,
``compile_prefill``) and its decode threads.

* ``torch.compile`` of the decode step computes what the eager step computes: on the same
  weights and cache contents, logits within ``LOGITS_TOL`` (relative) and identical greedy
  tokens, over rows of different lengths, as the running rows shrink to one (the row count and
  the key length are dynamic; one row compiles once more) -- for the qkv-bias model and the
  q/k-layernorm one.
* ``torch.compile`` of the prefill step computes what the eager step computes (logits and the
  cache it writes within ``LOGITS_TOL``) over fresh, shared-row, cached-prefix and
  single-sequence steps; both graphs are compiled at the first step, and no later step compiles
  (``fail_on_recompile``): the shapes no warmed graph fits, and steps over
  ``PREFILL_COMPILE_MAX_SCORES``, run eagerly.
* The engine with ``compile_decode`` (alone and with ``compile_prefill``) and with decode steps
  on all threads generates the same greedy tokens as the default engine.
* Bad settings fail with the value named: tp > 1 with either compile switch (``BatchedForward``,
  ``serve``), negative threads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.rollout.embedded.batched_forward import PREFILL_WARM_TOKENS
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_embedded_engine import MAX_SEQ, MODEL, QWEN3_LIKE, _build, _prompts
from tests.tolerances import fp32_tol, gpt_terms

LOGITS_TOL = fp32_tol(gpt_terms(QWEN3_LIKE, MAX_SEQ), 1.0)
"""Logit and cache differences relative to the compared tensor's largest |entry|: inductor fuses
and reorders a forward's fp32 sums (~1.8e3 terms with the q/k norms: ~2e-4). A fused kernel
reading the wrong cache slot or row moves logits by O(1)."""


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |a|."""
    return float((a - b).abs().max()) / float(a.abs().max())


def _eager_vs_compiled(model):
    """Prefill the test prompts into an eager and a compiled forward over the same weights, then
    decode greedily, dropping the last row every 4 steps down to one row: (max |logit diff|
    relative to the eager logits' largest |entry|, eager tokens, compiled tokens)."""
    from megatron_earl.rollout.embedded.batched_forward import BatchedForward
    from megatron_earl.rollout.embedded.step import Batch

    chunks, _ = _build(ParallelLayout(), None, model)
    eager = BatchedForward(chunks[0], 6, MAX_SEQ)
    compiled = BatchedForward(chunks[0], 6, MAX_SEQ, compile_decode=True)
    prompts = _prompts()
    prefill = Batch(tuple(range(len(prompts))), tuple(prompts), (0,) * len(prompts))
    worst = _rel_diff(eager(prefill), compiled(prefill))
    tokens = [eager(prefill).argmax(-1).tolist()]  # the prefill is eager in both
    lengths = [len(p) for p in prompts]
    mine, theirs = [], []
    graphs = []  # compiled graphs after each decode step: none is added after the first
    for step in range(4 * len(prompts)):
        n = len(prompts) - step // 4
        batch = Batch.decode(lengths[:n], tokens[-1][:n])
        a, b = eager(batch), compiled(batch)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        worst = max(worst, _rel_diff(a, b))
        mine.append(a.argmax(-1).tolist())
        theirs.append(b.argmax(-1).tolist())
        tokens.append(mine[-1])
        lengths = [length + 1 for length in lengths]
    return worst, mine, theirs, graphs


@pytest.mark.parametrize("model", [MODEL, QWEN3_LIKE], ids=["qkv_bias", "qk_layernorm"])
def test_compiled_decode_equals_eager(model):
    """... and both graphs (rows 2..max, one row) are compiled at the first decode step: the
    steps that shrink to a single row compile nothing more."""
    worst, eager, compiled, graphs = run_distributed(
        _eager_vs_compiled, 1, args=(model,), timeout_s=600
    )[0]
    assert compiled == eager
    assert worst <= LOGITS_TOL
    assert graphs[0] >= 2 and graphs == [graphs[0]] * len(graphs), graphs


def _prefill_eager_vs_compiled(model):
    """The same prefill steps through an eager and a ``compile_prefill`` forward over the same
    weights: fresh sequences of different lengths in rows out of order, a GRPO-style group (one
    sequence's keys also written to a second row), continuations of cached prefixes, one
    sequence alone; then the shapes that run eagerly: prompt log-probs (logits from several
    tokens of a sequence), of several sequences and of one, one-token continuations, a step
    over the size limit. Every step after the first runs under ``fail_on_recompile``. Returns
    (max |logit diff|, max |cache diff| over the written positions, both relative to the eager
    tensor's largest |entry|, compiled graphs after each step, which steps ran the compiled graph,
    the token count of the two warm-up steps, and per compiled step whether every index size went
    to dynamo as an explicit hint equal to it)."""
    from megatron_earl.rollout.embedded import batched_forward as bf
    from megatron_earl.rollout.embedded.batched_forward import BatchedForward
    from megatron_earl.rollout.embedded.step import Batch

    chunks, _ = _build(ParallelLayout(), None, model)
    eager = BatchedForward(chunks[0], 6, MAX_SEQ)
    compiled = BatchedForward(chunks[0], 6, MAX_SEQ, compile_prefill=True)
    ran, hinted, marks = [], [], []
    run_compiled = compiled._prefill_compiled

    def counted(step, **kwargs):
        ran.append(step.ids.numel())
        hinted.append(all(hint == t.size(0) for t, hint in marks[-len(step) :]))
        return run_compiled(step, **kwargs)

    compiled._prefill_compiled = counted
    mark_dynamic = torch._dynamo.mark_dynamic

    def recorded(t, index, **kwargs):
        marks.append((t, kwargs.get("hint_override")))
        return mark_dynamic(t, index, **kwargs)

    torch._dynamo.mark_dynamic = recorded
    p = _prompts()  # lengths 5, 17, 9, 23, 3, 12
    steps = [
        Batch((2, 0, 1), (p[0], p[1], p[2]), (0, 0, 0)),
        Batch((3, 5), (p[3], p[4]), (0, 0), shared=((4,), ())),
        Batch((0, 2), (p[5][:4], p[5][4:6]), (17, 5)),
        Batch((1,), (p[5][:3],), (9,)),
        Batch((0, 2), (p[5][:4], p[5][4:6]), (21, 7), logits_from=(1, 0)),  # prompt logits: eager
        Batch((5,), (p[1][:4],), (3,), logits_from=(1,)),  # one sequence, 3 logits: eager
        Batch((0, 2), ((p[1][0],), (p[1][1],)), (25, 9)),  # one new token each: eager
        Batch((4, 3), (p[0], p[2][:2]), (23, 23)),  # run over the lowered limit: eager
    ]
    worst, graphs, used = 0.0, [], []
    for i, batch in enumerate(steps):
        if i == len(steps) - 1:
            bf.PREFILL_COMPILE_MAX_SCORES = 0
        before = len(ran)
        stance = "default" if i == 0 else "fail_on_recompile"
        with torch.compiler.set_stance(stance):
            worst = max(worst, _rel_diff(eager(batch), compiled(batch)))
        used.append(len(ran) > before)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # Compare what the steps wrote: elsewhere the compiled forward's cache holds its warm-up.
    written = torch.zeros(6, MAX_SEQ, dtype=torch.bool)
    for batch in steps:
        shared = batch.shared or ((),) * len(batch.rows)
        for row, start, tokens, more in zip(batch.rows, batch.starts, batch.tokens, shared):
            written[[row, *more], start : start + len(tokens)] = True
    cache = max(
        _rel_diff(
            a[:, :, :MAX_SEQ].permute(0, 2, 1, 3)[written],
            b[:, :, :MAX_SEQ].permute(0, 2, 1, 3)[written],
        )
        for a, b in zip(eager.cache.buffers(), compiled.cache.buffers())
    )
    torch._dynamo.mark_dynamic = mark_dynamic
    # The last layer's attention for the last tokens only (``_attend_last``, both forwards)
    # against the same step attending for every token (prompt log-probs: ``_attend_ragged``):
    # two sequences of 4 and 2 new tokens after cached prefixes of 17 and 5. Run again, the
    # step writes the same keys and values.
    again = steps[2]
    every = eager(dataclasses.replace(again, logits_from=(0, 0)))  # [4 + 2, V]
    last_vs_every = _rel_diff(every[[3, 5]], eager(again))
    return worst, cache, graphs, used, ran[:2], hinted, last_vs_every


@pytest.mark.parametrize("model", [MODEL, QWEN3_LIKE], ids=["qkv_bias", "qk_layernorm"])
def test_compiled_prefill_equals_eager(model):
    """... both prefill graphs (several sequences: every row with ``PREFILL_WARM_TOKENS``
    tokens; one sequence) are compiled at the first step, so no later step compiles; the shapes
    no warmed graph fits and the step over ``PREFILL_COMPILE_MAX_SCORES`` run eagerly."""
    worst, cache, graphs, used, warm, hinted, last_vs_every = run_distributed(
        _prefill_eager_vs_compiled, 1, args=(model,), timeout_s=600
    )[0]
    assert last_vs_every <= LOGITS_TOL, last_vs_every
    # Compiled on a step of the engine's scale (inductor threads its kernels by those sizes),
    # whose sizes are explicit hints (inductor's cache keys on them); later steps pass none.
    assert warm == [6 * PREFILL_WARM_TOKENS, PREFILL_WARM_TOKENS], warm
    assert hinted[:2] == [True, True] and not any(hinted[2:]), hinted
    assert worst <= LOGITS_TOL and cache <= LOGITS_TOL, (worst, cache)
    assert used == [True, True, True, True, False, False, False, False], used
    assert graphs[0] >= 2 and graphs == [graphs[0]] * len(graphs), graphs


def _engine_greedy(config_kwargs: dict):
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        drive_all,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    chunks, _ = _build(ParallelLayout(), None, MODEL)
    config = EmbeddedEngineConfig(max_batch_size=3, max_seq_len=MAX_SEQ, **config_kwargs)
    engine = EmbeddedEngine(chunks, MODEL, config)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    results = run_engine(
        engine, lambda eng: drive_all(eng, [GenerateRequest(p, greedy) for p in _prompts()])
    )
    return [r.output_ids for r in results]


def test_engine_settings_change_no_token():
    default = run_distributed(_engine_greedy, 1, args=({},), timeout_s=300)[0]
    for kwargs in (
        {"compile_decode": True},
        {"compile_decode": True, "compile_prefill": True},
        {"decode_threads": 0},
    ):
        assert run_distributed(_engine_greedy, 1, args=(kwargs,), timeout_s=600)[0] == default


def _compile_at_tp2():
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.batched_forward import BatchedForward

    initialize_layout(ParallelLayout(tp=2))
    chunks = build_model(MODEL)
    with pytest.raises(ValueError, match=r"compile_decode needs tp = 1 .* got tp=2"):
        BatchedForward(chunks[0], 2, MAX_SEQ, compile_decode=True)


def test_compile_decode_refuses_tp():
    run_distributed(_compile_at_tp2, 2, timeout_s=120)


def test_decode_threads_must_be_non_negative():
    from megatron_earl.rollout.embedded.engine import EmbeddedEngineConfig

    with pytest.raises(ValueError, match=r"decode_threads must be >= 0 .* got -1"):
        EmbeddedEngineConfig(decode_threads=-1)


def _serve_engine_settings():
    from megatron_earl.rollout.serve.server import build_engine, parse_args

    argv = ["--seed", "0", "--max-seq-len", "64", "--enable-torch-compile", "--decode-threads", "0"]
    engine, _ = build_engine(parse_args([*argv, "--compile-prefill"]))
    return engine.config.compile_decode, engine.config.compile_prefill, engine.config.decode_threads


def test_serve_flags_reach_the_engine(capsys):
    """``serve --compile-decode`` (SGLang's ``--enable-torch-compile``), ``--compile-prefill``
    and ``--decode-threads`` set the engine's settings; a compiled TP engine and negative
    threads are refused by name."""
    from megatron_earl.rollout.serve.server import parse_args

    assert run_distributed(_serve_engine_settings, 1, timeout_s=300)[0] == (True, True, 0)
    defaults = parse_args([])
    assert (defaults.compile_decode, defaults.compile_prefill, defaults.decode_threads) == (
        False,
        False,
        1,
    )
    for argv, message, value in (
        (
            ["--compile-decode", "--tp-size", "2"],
            "--compile-decode needs --tp-size 1 ",
            "got --tp-size 2",
        ),
        (
            ["--compile-prefill", "--tp-size", "2"],
            "--compile-prefill needs --tp-size 1 ",
            "got --tp-size 2",
        ),
        (["--decode-threads", "-1"], "--decode-threads must be >= 0 ", "got -1"),
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert message in err and value in err, err
