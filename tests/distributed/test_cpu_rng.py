"""The CPU RNG tracker: ``fork`` swaps per-name CPU generator states (TP ranks draw different
dropout masks in TP regions, the default stream is untouched), and full activation recompute with
dropout reproduces the gradients of the run without recompute exactly (bitwise)."""

from __future__ import annotations

import dataclasses

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.testing.distributed import run_distributed

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    vocab_size=64,
    attention_dropout=0.2,
    hidden_dropout=0.2,
)


def _fork_semantics():
    from megatron.core import tensor_parallel

    from megatron_earl import runtime
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import use_layout

    use_layout(ParallelLayout(tp=2))
    runtime.seed(3)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default_before = torch.get_rng_state()
    with tracker.fork():
        tp_draw = torch.rand(4)
        with tracker.fork("data-parallel-rng"):
            dp_draw = torch.rand(4)
        tp_draw_2 = torch.rand(4)
    default_unchanged = torch.equal(torch.get_rng_state(), default_before)
    with tracker.fork():
        tp_draw_3 = torch.rand(4)  # the stream continues where it stopped
    return {
        "tracker": type(tracker).__name__,
        "tp": tp_draw,
        "dp": dp_draw,
        "tp2": tp_draw_2,
        "tp3": tp_draw_3,
        "default_unchanged": default_unchanged,
    }


def test_fork_swaps_per_name_cpu_states():
    r0, r1 = run_distributed(_fork_semantics, 2, timeout_s=120)
    assert r0["tracker"] == "CpuRNGStatesTracker"
    assert r0["default_unchanged"] and r1["default_unchanged"]
    assert not torch.equal(r0["tp"], r1["tp"])  # tensor-parallel seed differs per TP rank
    assert torch.equal(r0["dp"], r1["dp"])  # data-parallel seed is shared
    assert len({tuple(r0[k].tolist()) for k in ("tp", "tp2", "tp3")}) == 3


def _grads(recompute: str | None, weights, dropout_seed: int = 9):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import full_state_dict, load_full_state_dict

    use_layout(ParallelLayout(tp=torch.distributed.get_world_size()))
    runtime.seed(5)
    (chunk,) = build_model(dataclasses.replace(MODEL, recompute_granularity=recompute))
    if weights is not None:
        load_full_state_dict([chunk], weights)
    elif torch.distributed.get_world_size() == 1:
        weights = full_state_dict([chunk])
    runtime.seed(dropout_seed)  # identical dropout streams for runs with the same seed
    tokens = torch.randint(0, MODEL.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = chunk(tokens, torch.arange(24).expand(2, 24), None)
    logits.float().pow(2).mean().backward()
    return weights, logits.detach(), {n: p.grad.clone() for n, p in chunk.named_parameters()}


def _recompute_vs_plain():
    weights, logits_plain, grads_plain = _grads(None, None)
    _, logits_re, grads_re = _grads("full", weights)
    _, logits_other_seed, _ = _grads(None, weights, dropout_seed=10)
    dropout_active = not torch.equal(logits_plain, logits_other_seed)
    return logits_plain, logits_re, grads_plain, grads_re, dropout_active


def test_recompute_with_dropout_reproduces_gradients_exactly():
    for world in (1, 2):
        results = run_distributed(_recompute_vs_plain, world, timeout_s=180)
        for logits_plain, logits_re, grads_plain, grads_re, dropout_active in results:
            assert dropout_active
            assert torch.equal(logits_plain, logits_re)
            for name, grad in grads_plain.items():
                assert torch.equal(grad, grads_re[name]), name
