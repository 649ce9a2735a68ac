"""Mixture-of-experts models on megatron-core (CPU, gloo): a tiny MoE (4 experts, top-2, 2 layers,
hidden 64) builds with megatron-core's ``MoELayer`` (``SequentialMLP`` experts, the all-to-all
dispatcher) and trains through the RL step at ep1 (one process) and at ep2 (two processes,
tp1dp2ep2, and tp2 with etp1 under sequence parallelism), with the same updated weights and
metrics as one process; ep2 logits equal ep1's; the router's aux and z losses reach the router's
gradient through the RL loss exactly as megatron-core's schedule scales them; the aux-loss-free
expert bias moves after a step; unequal micro-batch counts across an expert group are one clear
error on every rank. Tolerances: ``tests/tolerances.py`` (fp32 sums in another order)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_rl_step import COMPARED, _samples
from tests.tolerances import ADAM_EPS, assert_fp32_close, fp32_tol, gpt_terms, weight_tol

MOE = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=96,
    make_vocab_size_divisible_by=32,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    sequence_parallel=True,  # needed by MoE at tp > 1; a no-op at tp = 1
)
LENGTHS = [9, 17, 4, 12, 6, 20, 11, 7]  # tests.distributed.test_rl_step's samples
BUDGET = 64
"""Tokens per micro-batch: one micro-batch per rank at dp2 (30 and 56 tokens), two in one process
(the main loss does not depend on the grouping; every expert group runs the same count)."""
NUM_TERMS = gpt_terms(MOE, max(LENGTHS), grad_tokens=sum(LENGTHS))
"""A gradient's chain of fp32 sums (~2.8e3 terms)."""
TOL = fp32_tol(NUM_TERMS, 1.0)
"""Metrics, relative to max(1, |value|): means and norms over the step's tokens of that chain."""
FORWARD_TERMS = gpt_terms(MOE, max(LENGTHS))
"""A logit's chain of fp32 sums (~1.3e3 terms: bound ~1.6e-4 x max |logit|, ~1e-4 here): the
same arithmetic per token at ep1 and ep2 (router, two experts' GEMMs, the weighted sum), only the
GEMM row blocking and the order of the top-k sum may differ (6e-8 observed)."""
LR = 1e-3
LAYOUTS = [ParallelLayout(dp=2, ep=2), ParallelLayout(tp=2, ep=2, etp=1)]


def _config(budget: int = BUDGET, **loss_kw):
    from megatron_earl.config.loss import PolicyLossConfig
    from megatron_earl.training.rl_step import RLStepConfig

    loss = {"aggregation": "seq_mean_token_mean", "clip_eps_high": 0.28, **loss_kw}
    return RLStepConfig(loss=PolicyLossConfig(**loss), max_tokens_per_micro_batch=budget)


def _setup(layout: ParallelLayout, weights, model: ModelConfig):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import full_state_dict, load_full_state_dict
    from megatron_earl.training.setup import (
        OptimConfig,
        build_optimizer,
        wire_schedule_hooks,
        wrap_ddp,
    )

    initialize_layout(layout)
    runtime.seed(11)
    chunks = build_model(model)
    weights = full_state_dict(chunks) if weights is None else weights
    load_full_state_dict(chunks, weights)
    optim = OptimConfig(lr=LR, clip_grad=1.0, adam_eps=ADAM_EPS)
    ddp = wrap_ddp(chunks, optim)
    optimizer = build_optimizer(ddp, optim)
    wire_schedule_hooks(ddp, optimizer)
    return chunks, ddp, optimizer, weights


def _train(layout: ParallelLayout, weights, steps: int, budget: int = BUDGET):
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_earl.redistribute.geometry import full_state_dict, shard_pieces
    from megatron_earl.training.rl_step import rl_train_step
    from tests.tolerances import grad_maxima

    chunks, ddp, optimizer, weights = _setup(layout, weights, MOE)
    mlp = chunks[0].decoder.layers[0].mlp
    classes = (type(mlp), type(mlp.experts), type(mlp.token_dispatcher))
    assert classes == (MoELayer, SequentialMLP, MoEAlltoAllTokenDispatcher), classes
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = _samples()[dp_rank :: layout.dp]
    metrics, grads = [], []
    for _ in range(steps):
        metrics.append(rl_train_step(ddp, optimizer, mine, _config(budget)))
        grads.append(grad_maxima(shard_pieces(chunks)))
    return {
        "weights": weights,
        "metrics": metrics,
        "grad_max": grads,
        "params": [(p.key, p.region, p.local.detach().clone()) for p in shard_pieces(chunks)],
        "final": full_state_dict(chunks) if layout.world_size == 1 else None,
        "local_experts": parallel_state.get_expert_model_parallel_world_size(),
    }


@pytest.fixture(scope="module")
def reference():
    (res,) = run_distributed(_train, 1, args=(ParallelLayout(), None, 2), timeout_s=180)
    return res


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_moe_model_trains_at_ep1_and_ep2(reference, layout):
    """Forward, backward and two optimizer steps of the RL loss: every rank's expert and dense
    shards equal the one-process run's (``weight_tol``: Adam's steps on gradients within their
    fp32 bound), the metrics too (TOL), every step applied."""
    from megatron_earl.redistribute.geometry import region_slices

    results = run_distributed(_train, 2, args=(layout, reference["weights"], 2), timeout_s=300)
    for res in results:
        assert res["local_experts"] == 2
        for key, region, local in res["params"]:
            expected = reference["final"][key][region_slices(region)].reshape(local.shape)
            grad_max = [step[key] for step in reference["grad_max"]]
            tol = weight_tol(LR, NUM_TERMS, grad_max, expected)
            torch.testing.assert_close(local, expected, rtol=0, atol=tol, msg=key)
        for got, want in zip(res["metrics"], reference["metrics"], strict=True):
            for k in COMPARED:
                assert abs(got[k] - want[k]) <= TOL * max(1.0, abs(want[k])), (k, got[k], want[k])
            assert got["skipped_step"] == 0 and got["update_ok"] == 1
    assert any("experts" in key for key, _, _ in results[0]["params"])


def _logits(layout: ParallelLayout, weights):
    from megatron.core import parallel_state

    chunks, _, _, weights = _setup(layout, weights, MOE)
    model = chunks[0].eval()
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, MOE.vocab_size, (1, n), generator=gen) for n in (13, 21)]
    if layout.world_size > 1:  # each data-parallel rank its own sequence (unequal token counts)
        sequences = [sequences[parallel_state.get_data_parallel_rank()]]
    with torch.no_grad():
        out = [model(s, torch.arange(s.size(1))[None], None) for s in sequences]
    return {"weights": weights, "logits": out}


def test_ep2_logits_equal_ep1():
    (ref,) = run_distributed(_logits, 1, args=(ParallelLayout(), None), timeout_s=180)
    layout = ParallelLayout(dp=2, ep=2)
    results = run_distributed(_logits, 2, args=(layout, ref["weights"]), timeout_s=180)
    for rank, res in enumerate(results):
        assert_fp32_close(res["logits"][0], ref["logits"][rank], FORWARD_TERMS)


def _aux_gradient(model: ModelConfig):
    """One RL step whose policy loss has no gradient (advantages 0, no KL, no entropy term): the
    router's gradient is the aux/z losses' alone. Returns it, the gradient of the same losses
    from a plain backward of the same packed micro-batch (scale 1: one micro-batch, dp 1, fp32),
    and the expert bias before and after the step."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_earl.models.gpt import build_model
    from megatron_earl.redistribute.geometry import load_full_state_dict
    from megatron_earl.training.microbatch import build_micro_batches
    from megatron_earl.training.rl_step import rl_train_step

    chunks, ddp, optimizer, weights = _setup(ParallelLayout(), None, model)
    samples = [{**s, "advantages": torch.zeros_like(s["advantages"])} for s in _samples()]
    router = chunks[0].decoder.layers[0].mlp.router
    bias_before = router.expert_bias.clone() if model.moe_router_enable_expert_bias else None
    budget = sum(LENGTHS)
    metrics = rl_train_step(ddp, optimizer, samples, _config(budget, kl_coef=0.0))
    assert metrics["num_micro_batches"] == 1 and metrics["skipped_step"] == 0
    got = router.weight.main_grad.clone()
    bias_after = router.expert_bias.clone() if model.moe_router_enable_expert_bias else None

    (plain,) = build_model(model)
    load_full_state_dict([plain], weights)
    (mb,) = build_micro_batches(samples, budget)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(()))
    out = plain(mb["tokens"], mb["position_ids"], None, packed_seq_params=mb["packed_seq_params"])
    (out * 0).sum().backward()  # only the losses the router attached to its activations
    want = plain.decoder.layers[0].mlp.router.weight.grad
    return {"got": got, "want": want, "bias": (bias_before, bias_after)}


def test_router_aux_loss_reaches_the_rl_gradient():
    with_aux = dataclasses.replace(MOE, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    (res,) = run_distributed(_aux_gradient, 1, args=(with_aux,), timeout_s=180)
    assert float(res["want"].abs().max()) > 0
    assert_fp32_close(res["got"], res["want"], NUM_TERMS)
    # without aux and z losses the router gets no gradient at all from this step
    (res,) = run_distributed(_aux_gradient, 1, args=(MOE,), timeout_s=180)
    assert float(res["got"].abs().max()) == 0.0


def test_expert_bias_moves_after_a_step():
    biased = dataclasses.replace(
        MOE,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none",
    )
    (res,) = run_distributed(_aux_gradient, 1, args=(biased,), timeout_s=180)
    before, after = res["bias"]
    assert float(before.abs().max()) == 0.0 and float(after.abs().max()) > 0


def _unequal(layout: ParallelLayout, weights):
    try:
        _train(layout, weights, 1, budget=24)
    except ValueError as err:
        return str(err)
    return None


def test_unequal_micro_batch_counts_in_an_expert_group_fail_on_every_rank(reference):
    layout = ParallelLayout(dp=2, ep=2)
    results = run_distributed(_unequal, 2, args=(layout, reference["weights"]), timeout_s=180)
    for message in results:
        assert message is not None and "same number of micro-batches" in message
        assert "between 2 and 3" in message


def _switch(layouts: list[ParallelLayout], cycles: int):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.groups import group_cache
    from megatron_earl.parallel.state import use_layout

    rank = dist.get_rank()
    created, groups_ok, models = [], True, {}
    tokens = torch.arange(10)[None] % MOE.vocab_size
    for _ in range(cycles):
        for layout in layouts:
            use_layout(layout)
            megatron = {
                "ep": ps.get_expert_model_parallel_group(),
                "etp": ps.get_expert_tensor_parallel_group(),
                "edp": ps.get_expert_data_parallel_group(),
            }
            for axis, group in megatron.items():
                mine = next(g for g in layout.expert_groups(axis) if rank in g)
                groups_ok &= tuple(sorted(dist.get_process_group_ranks(group))) == mine
            if layout not in models:
                runtime.seed(3)
                (model,) = build_model(MOE)
                with torch.no_grad():
                    models[layout] = (model, model.eval()(tokens, torch.arange(10)[None], None))
            else:
                model, logits = models[layout]
                with torch.no_grad():
                    groups_ok &= torch.equal(model(tokens, torch.arange(10)[None], None), logits)
        created.append(group_cache().stats.created)
    return {"groups_ok": groups_ok, "created": created}


def test_expert_groups_are_megatrons_and_cached_across_switches():
    """tp2 <-> dp2ep2 <-> tp2ep2etp1: megatron-core's expert groups are the layout's
    ``expert_groups``, no group is created after the first cycle, and a model built in an expert
    layout gives identical logits on every return to it."""
    layouts = [
        ParallelLayout(tp=2),
        ParallelLayout(dp=2, ep=2),
        ParallelLayout(tp=2, ep=2, etp=1),
    ]
    results = run_distributed(_switch, 2, args=(layouts, 3), timeout_s=180)
    for res in results:
        assert res["groups_ok"]
        assert res["created"][0] > 0 and len(set(res["created"])) == 1, res["created"]
