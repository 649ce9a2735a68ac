"""The embedded engine's compiled decode step (``compile_decode``) and its decode threads.

* ``torch.compile`` of the decode step computes what the eager step computes: on the same
  weights and cache contents, logits within 1e-5 (fp32) and identical greedy tokens, over rows of
  different lengths, as the running rows shrink to one (the row count and the key length are
  dynamic; one row compiles once more) -- for the qkv-bias model and the q/k-layernorm one.
* The engine with ``compile_decode`` and with decode steps on all threads generates the same
  greedy tokens as the default engine.
* Bad settings fail with the value named: tp > 1 with ``compile_decode``, negative threads.
"""

from __future__ import annotations

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_embedded_engine import MAX_SEQ, MODEL, QWEN3_LIKE, _build, _prompts

LOGITS_TOL = 1e-5


def _eager_vs_compiled(model):
    """Prefill the test prompts into an eager and a compiled forward over the same weights, then
    decode greedily, dropping the last row every 4 steps down to one row: (max |logit diff|,
    eager tokens, compiled tokens)."""
    from megatron_earl.rollout.batched_forward import Batch, BatchedForward

    chunks, _ = _build(ParallelLayout(), None, model)
    eager = BatchedForward(chunks[0], 6, MAX_SEQ)
    compiled = BatchedForward(chunks[0], 6, MAX_SEQ, compile_decode=True)
    prompts = _prompts()
    prefill = Batch(tuple(range(len(prompts))), tuple(prompts), (0,) * len(prompts))
    worst = float((eager(prefill) - compiled(prefill)).abs().max())
    tokens = [eager(prefill).argmax(-1).tolist()]  # the prefill is eager in both
    lengths = [len(p) for p in prompts]
    mine, theirs = [], []
    graphs = []  # compiled graphs after each decode step: none is added after the first
    for step in range(4 * len(prompts)):
        n = len(prompts) - step // 4
        batch = Batch.decode(lengths[:n], tokens[-1][:n])
        a, b = eager(batch), compiled(batch)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        worst = max(worst, float((a - b).abs().max()))
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


def _engine_greedy(config_kwargs: dict):
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded import (
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
    for kwargs in ({"compile_decode": True}, {"decode_threads": 0}):
        assert run_distributed(_engine_greedy, 1, args=(kwargs,), timeout_s=600)[0] == default


def _compile_at_tp2():
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.batched_forward import BatchedForward

    initialize_layout(ParallelLayout(tp=2))
    chunks = build_model(MODEL)
    with pytest.raises(ValueError, match=r"compile_decode needs tp = 1 .* got tp=2"):
        BatchedForward(chunks[0], 2, MAX_SEQ, compile_decode=True)


def test_compile_decode_refuses_tp():
    run_distributed(_compile_at_tp2, 2, timeout_s=120)


def test_decode_threads_must_be_non_negative():
    from megatron_earl.rollout.embedded import EmbeddedEngineConfig

    with pytest.raises(ValueError, match=r"decode_threads must be >= 0 .* got -1"):
        EmbeddedEngineConfig(decode_threads=-1)


def _serve_engine_settings():
    from megatron_earl.rollout.server import build_engine, parse_args

    argv = ["--seed", "0", "--max-seq-len", "64", "--enable-torch-compile", "--decode-threads", "0"]
    engine, _ = build_engine(parse_args(argv))
    return engine.config.compile_decode, engine.config.decode_threads


def test_serve_flags_reach_the_engine(capsys):
    """``serve --compile-decode`` (SGLang's ``--enable-torch-compile``) and ``--decode-threads``
    set the engine's settings; a compiled TP engine and negative threads are refused by name."""
    from megatron_earl.rollout.server import parse_args

    assert run_distributed(_serve_engine_settings, 1, timeout_s=300)[0] == (True, 0)
    defaults = parse_args([])
    assert (defaults.compile_decode, defaults.decode_threads) == (False, 1)
    for argv, message, value in (
        (
            ["--compile-decode", "--tp-size", "2"],
            "--compile-decode needs --tp-size 1 ",
            "got --tp-size 2",
        ),
        (["--decode-threads", "-1"], "--decode-threads must be >= 0 ", "got -1"),
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert message in err and value in err, err
