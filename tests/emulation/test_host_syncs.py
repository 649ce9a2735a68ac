"""Host-sync budgets, counted on the emulation tier (``emulated_syncs``; the figures of
``megatron-earl bench host-syncs``, ``docs/measurements/host_syncs.md``).

* The counter sees every kind of device -> host sync it names, once per call, and nothing outside
  a ``host_syncs()`` block or on the host.
* A train micro-batch and an experience (log-prob) micro-batch pay the same syncs at 2 layers as
  at 4 (nothing per layer: a sync per layer would add 2 per micro-batch; the packed attention
  and RoPE read the host's boundaries), within a
  stated budget, packed whole at tp1 and cp2 and as prefix trees.
* The train step reads its metrics back in one transfer, and the whole of ``rl_step`` pays a
  fixed number of syncs per step whatever the number of micro-batches.
* An embedded-engine decode step pays at most one sync, a read of 16 bytes per row (the sampled
  ids and their log-probs; the sampling runs on the device, the logits stay there).
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.emulation.common import EMULATED

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=96,
    make_vocab_size_divisible_by=32,
)
LOSS = PolicyLossConfig(clip_eps_high=0.28, aggregation="token_mean")
"""The demo's loss (configs/demo_cpu.yaml's ``train.loss``)."""
TRAIN_BUDGET = 5
"""Syncs per train micro-batch: the input checks of the loss (``losses.common.SampleIndex``'s
seq-id range, ``losses.base``'s seq-id check) and of the output layer (``logprobs.head_logprobs``'
target range), 5 reads of single values."""
EXPERIENCE_BUDGET = 2
"""Syncs per log-prob micro-batch: the output layer's target-range check."""
RL_STEP_SYNCS = 4
"""Syncs of ``training/rl_step.py`` itself per train step: the non-finite flags, the normaliser
counts and the metrics, each one transfer for every micro-batch, and the gradient check."""


def _kinds():
    import torch

    from megatron_earl import emulated_device, runtime

    x = torch.arange(6.0, device=runtime.device())
    host = torch.arange(6.0)
    with emulated_device.host_syncs() as syncs:
        x.sum().item(), float(x[1]), bool(x[2] > 1), x.tolist(), torch.equal(x, x)
        x.nonzero(), x[x > 2], x.cpu(), torch.unique(x), torch.masked_select(x, x > 1)
        torch.repeat_interleave(torch.tensor([1, 2], device=x.device))
        x[x > 4] = 0.0  # masked_fill on CUDA: no sync
        x.to("cpu", non_blocking=True)  # no sync until ...
        torch.emu.synchronize()  # ... this one
        host.sum().item(), host.tolist()  # host values: no sync
        torch.ones(3).to(x.device)  # a blocking host -> device copy: counted apart
    x[0].item()  # outside the block
    return {k.value: n for k, n in syncs.by_kind().items()}, syncs.total


def test_counter_sees_each_kind_once_per_call():
    (result,) = run_distributed(_kinds, 1, timeout_s=120, env=EMULATED)
    kinds, total = result
    assert kinds == {
        "item": 2 + 1,  # .item(), float(); bool() reaches is_nonzero
        "tolist": 1,
        "equal": 1,
        "nonzero": 2,  # nonzero, boolean-mask index
        "to_host": 1,
        "unique": 1,
        "masked_select": 1,
        "repeat_interleave": 1,
        "synchronize": 1,
        "to_device": 2,  # torch.tensor(..., device=) and .to(device)
    }
    assert total == sum(kinds.values()) - kinds["to_device"]


def _setting(num_layers: int, layout: str, tree: bool, decode: bool):
    from megatron_earl.bench.host_syncs import measure_setting

    model = dataclasses.replace(MODEL, num_layers=num_layers)
    return measure_setting(model, LOSS, layout, tree, decode=decode)


def _run(num_layers: int, layout: str, tree: bool, decode: bool = False):
    world = ParallelLayout.parse(layout).world_size
    args = (num_layers, layout, tree, decode)
    return run_distributed(_setting, world, args=args, timeout_s=600, env=EMULATED)


def _rl_step_syncs(part) -> int:
    """Syncs asked for by ``training/rl_step.py`` itself (not through Megatron)."""
    ours = "megatron_earl/training/rl_step.py"
    return sum(
        n for kind, site, n in part["sites"] if site.startswith(ours) and kind != "to_device"
    )


@pytest.mark.parametrize(
    "layout,tree", [("tp1", False), ("cp2", False), ("tp1", True)], ids=["tp1", "cp2", "tp1-tree"]
)
def test_syncs_per_micro_batch_do_not_grow_with_layers(layout, tree):
    small, large = _run(2, layout, tree), _run(4, layout, tree)
    for rank_small, rank_large in zip(small, large, strict=True):
        for kind, budget in (("train", TRAIN_BUDGET), ("experience", EXPERIENCE_BUDGET)):
            per_mb = rank_small[kind]["per_unit"], rank_large[kind]["per_unit"]
            assert per_mb[0] == per_mb[1], (kind, per_mb, rank_large[kind]["sites"][:10])
            assert per_mb[1] <= budget, (kind, per_mb, rank_large[kind]["sites"][:10])
        train = rank_large["train"]
        # metrics: one transfer per step (the large run had 4 micro-batches)
        metrics = [n for kind, site, n in train["sites"] if "_host_metrics" in site]
        assert metrics == [1], train["sites"]
        assert _rl_step_syncs(train) == RL_STEP_SYNCS, train["sites"]


def test_decode_step_reads_the_host_at_most_once_and_never_the_logits():
    (result,) = _run(2, "tp1", True, decode=True)
    decode = result["decode"]
    assert decode["decode_steps"] > 0 and decode["per_unit"] <= 1, decode["sites"]
    # sampled on the device: one read of (id, log-prob) as 2 float64 per row, 16 bytes a row;
    # the [rows, V] logits (4 x 96 float32 = 1536 bytes here) never cross
    assert decode["bytes_per_unit"] <= 16 * decode["rows"], decode["sites"]
