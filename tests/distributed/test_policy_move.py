"""Moving the policy's master copy (weights + Adam state) between layouts on 2 gloo ranks.

A policy built in tp2 takes 2 RL steps, then moves to dp2, pp2 and back to tp2 with one step
after each move. Right after a move the master (parameters, Adam moments, step) equals the
master before it, bitwise; after each step the parameters and moments equal a reference policy
that took the same steps in tp2 without moving, within the fp32 bounds of ``tests/tolerances.py``
(the layouts differ only in floating-point reduction order; Adam with ``ADAM_EPS``). A master
moved before its first step (lazy Adam state) steps bitwise like one that never moved. With bf16
parameters, Megatron's fp32 main copies move
too (bitwise), and a master moved away and back steps bitwise like one that stayed. The
distributed optimizer is refused with a clear error, before
anything changes. Eval copies: the one in the destination layout is dropped, the others keep
their version. ``Policy.sync`` reshards a copy only when it is stale, and plans each (master, copy)
pair once (counted), re-planning after the master moves.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.redistribute.optimizer_state import init_adam_state
from megatron_earl.testing.distributed import run_distributed
from megatron_earl.testing.shards import assemble_regions
from tests.tolerances import (
    ADAM_EPS,
    U_FP32,
    adam_weight_tol,
    fp32_tol,
    gpt_terms,
    grad_maxima,
)

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
    tie_embeddings=True,
)
BF16 = dataclasses.replace(MODEL, params_dtype="bfloat16")
TP2, DP2, PP2 = ParallelLayout(tp=2), ParallelLayout(dp=2), ParallelLayout(pp=2)
LR = 1e-4
LENGTHS = [40, 24, 32, 16]
MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("param", "main", *MOMENTS)
NUM_TERMS = gpt_terms(MODEL, max(LENGTHS), grad_tokens=sum(LENGTHS))
"""A gradient's chain of fp32 sums (forward, backward, the step's tokens): ~3.6e3 terms."""


def _policy(optim_kwargs: dict | None = None, model: ModelConfig = MODEL):
    from megatron_earl.config.optim import OptimConfig
    from megatron_earl.orchestration.policy import Policy

    optim = OptimConfig(lr=LR, adam_eps=ADAM_EPS, **(optim_kwargs or {}))
    return Policy.build(model, {"train": TP2, "experience": DP2, "rollout": PP2}, optim, seed=5)


def _step(policy, step: int) -> None:
    """One RL step on this DP rank's share of the step's samples (every rank)."""
    from megatron.core import parallel_state

    from megatron_earl.selector.profile import synthetic_samples
    from megatron_earl.training.rl_step import RLStepConfig, rl_train_step

    samples = synthetic_samples(LENGTHS, MODEL.vocab_size, seed=100 + step)
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    config = RLStepConfig(max_tokens_per_micro_batch=64, vocab_size=MODEL.vocab_size)
    metrics = rl_train_step(policy.ddp_chunks, policy.optimizer, samples[rank::dp], config)
    assert metrics["skipped_step"] == 0
    policy.version += 1


def _snapshot(policy) -> dict:
    """This rank's regions of the parameters, their fp32 main copies (the parameters
    themselves in fp32), Adam's moments (as fp32), and the Adam step."""
    out: dict = {kind: [] for kind in KINDS}
    out["step"] = set()
    inner = policy.optimizer.optimizer
    for p in policy.master_pieces:
        main = getattr(p.param, "main_param", p.param)  # Megatron's fp32 copy of a bf16 param
        state = inner.state[main]
        views = {"param": p.local, "main": p.view_of(main)}
        views.update({kind: p.view_of(state[kind]) for kind in MOMENTS})
        for kind, view in views.items():
            out[kind].append((p.key, p.global_shape, p.region, view.detach().float().clone()))
        out["step"].add(float(state["step"]))
    out["grad_max"] = grad_maxima(policy.master_pieces)  # the last step's (after a step)
    return out


def _moved_run() -> dict:
    """tp2: 2 steps; -> dp2, step; -> pp2, step; -> tp2, step (snapshots around every move)."""
    from megatron_earl.parallel.state import use_layout

    policy = _policy()
    out: dict = {"moves": []}
    for step in (1, 2):
        _step(policy, step)
    assert policy.move_master(TP2) == {}
    for step, layout in ((3, DP2), (4, PP2), (5, TP2)):
        before = _snapshot(policy)
        for lay in policy.copies:
            policy.sync(lay)
        copy_versions = {lay: c.version for lay, c in policy.copies.items() if lay != layout}
        assert set(copy_versions.values()) <= {policy.version}
        rng = torch.get_rng_state()
        stats = policy.move_master(layout)
        assert torch.equal(rng, torch.get_rng_state())  # the run's RNG stream is untouched
        assert stats["move_s"] > 0 and stats["move_bytes_sent"] >= 0
        assert policy.train_layout == layout and layout not in policy.copies
        assert policy.chunks(layout) is policy.ddp_chunks
        assert {lay: c.version for lay, c in policy.copies.items()} == copy_versions
        assert all(policy.sync(lay) == {} for lay in policy.copies)  # still valid: no reshard
        out["moves"].append((before, _snapshot(policy)))
        _step(policy, step)
        out[step] = _snapshot(policy)
    # the old train layouts were dropped, not kept: ensure rebuilds their copies lazily
    use_layout(DP2)
    assert DP2 not in policy.copies and policy.ensure(DP2)
    return out


def _lazy_run() -> dict:
    """Move away and back before the first step (no Adam state yet), then step."""
    policy = _policy()
    policy.move_master(DP2)
    policy.move_master(TP2)
    _step(policy, 1)
    return _snapshot(policy)


def _bf16_runs() -> dict:
    """bf16 parameters (Megatron keeps fp32 main copies): one step, three moves, one step;
    and the same two steps without moving."""
    out: dict = {"moves": []}
    for name, layouts in (("reference", ()), ("moved", (DP2, PP2, TP2))):
        policy = _policy(model=BF16)
        _step(policy, 1)
        for layout in layouts:
            before = _snapshot(policy)
            policy.move_master(layout)
            out["moves"].append((before, _snapshot(policy)))
        _step(policy, 2)
        out[name] = _snapshot(policy)
    return out


def _reference_run() -> dict:
    policy = _policy()
    out = {}
    for step in range(1, 6):
        _step(policy, step)
        out[step] = _snapshot(policy)
    return out


def _all_runs() -> dict:
    runs = {"reference": _reference_run(), "moved": _moved_run(), "lazy": _lazy_run()}
    return runs | {"bf16": _bf16_runs()}


def _full(snapshots: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Global tensors per kind (``KINDS``) from every rank's snapshot."""
    return {kind: assemble_regions(s[kind] for s in snapshots) for kind in KINDS}


def _max_diff(a: dict, b: dict, kinds=KINDS) -> float:
    return max(float((a[k][key] - b[k][key]).abs().max()) for k in kinds for key in a[k])


def _bound(kind: str, value: torch.Tensor, grad_max: list[float], step: int) -> float:
    """fp32 bound of the difference after ``step`` steps whose first two ran in tp2 in both runs
    (the same bits) and the others in other layouts, with ``grad_max`` each step's largest
    |gradient entry| of the parameter."""
    grad_tols = [0.0, 0.0, *(fp32_tol(NUM_TERMS, g) for g in grad_max[2:step])]
    rounding = step * 2 * U_FP32 * float(value.abs().max())
    if kind == "exp_avg":  # a weighted sum of the gradients, weights summing to <= 1
        return max(grad_tols) + rounding
    if kind == "exp_avg_sq":  # the same of their squares: d(g^2) <= 2|g| d
        return 2 * max(grad_max[:step]) * max(grad_tols) + rounding
    return adam_weight_tol(LR, grad_tols[:step], float(value.abs().max()))


def test_move_master_keeps_weights_and_adam_state():
    results = run_distributed(_all_runs, 2, timeout_s=120)
    reference = [r["reference"] for r in results]
    moved = [r["moved"] for r in results]
    for i in range(3):  # each move: bitwise, parameters and moments and step
        before = _full([r["moves"][i][0] for r in moved])
        after = _full([r["moves"][i][1] for r in moved])
        assert _max_diff(before, after) == 0.0, f"move {i} is not lossless"
        steps = {s for r in moved for s in r["moves"][i][1]["step"]}
        assert steps == {float(i + 2)}, steps
    for step in (3, 4, 5):
        got, want = _full([r[step] for r in moved]), _full([r[step] for r in reference])
        bounds = {}
        for kind in KINDS:
            for key, value in want[kind].items():
                grad_max = [max(r[k]["grad_max"][key] for r in reference) for k in range(1, 6)]
                bounds[kind, key] = _bound(kind, value, grad_max, step)
                diff = float((got[kind][key] - value).abs().max())
                assert diff <= bounds[kind, key], (step, kind, key, diff, bounds[kind, key])
        # one step moves the parameters far more than their bound: lost moments would show
        previous = _full([r[step - 1] for r in reference])
        largest = max(b for (kind, _), b in bounds.items() if kind == "param")
        assert _max_diff(want, previous, ("param",)) > 10 * largest
    lazy = _full([r["lazy"] for r in results])
    first = _full([r[1] for r in reference])
    assert _max_diff(lazy, first) == 0.0, _max_diff(lazy, first)  # same layout: bitwise
    bf16 = [r["bf16"] for r in results]
    for i in range(3):  # fp32 main copies move too: nothing is rounded to bf16 on the way
        before, after = (_full([r["moves"][i][j] for r in bf16]) for j in (0, 1))
        assert _max_diff(before, after) == 0.0, f"bf16 move {i} is not lossless"
    got, want = _full([r["moved"] for r in bf16]), _full([r["reference"] for r in bf16])
    assert _max_diff(got, want) == 0.0  # moved away and back to tp2: the same update, bitwise


def _sync_plans() -> dict:
    """Three steps, each followed by syncs of both copies (twice) and of the train layout; then
    a move of the master to dp2 and one more step and sync. Counts the reshard plans made
    (``gather_plan`` calls) and compares a copy synced by the cached plan with a fresh reshard."""
    import megatron_earl.orchestration.policy as policy_mod
    from megatron_earl.redistribute.weight_exec import reshard_weights

    calls = []
    gather = policy_mod.gather_plan
    policy_mod.gather_plan = lambda *args: calls.append(args) or gather(*args)
    policy = _policy()
    out: dict = {"plans": [], "stats": []}
    for step in (1, 2, 3):
        _step(policy, step)
        out["stats"].append([policy.sync(lay) != {} for lay in (DP2, PP2, DP2, PP2, TP2)])
        out["plans"].append(len(calls))
    policy.move_master(DP2)  # drops the dp2 copy, the pp2 copy's plan is the old master's
    _step(policy, 4)
    out["stats"].append([policy.sync(lay) != {} for lay in (PP2, PP2, DP2)])
    out["plans"].append(len(calls))
    copy = policy.copies[PP2]
    cached = [p.local.detach().clone() for p in copy.pieces]
    for p in copy.pieces:
        p.local.detach().zero_()
    reshard_weights(policy.master_pieces, copy.pieces)  # planned afresh
    out["same"] = all(torch.equal(a, p.local) for a, p in zip(cached, copy.pieces, strict=True))
    return out


def test_sync_plans_once_per_master_and_copy():
    """A copy is resharded only when stale and never for the train layout; its plan is made at
    its first sync and reused until the master moves; the cached plan fills the copy exactly
    like a fresh one."""
    for res in run_distributed(_sync_plans, 2, timeout_s=120):
        assert res["stats"][:3] == [[True, True, False, False, False]] * 3
        assert res["stats"][3] == [True, False, False]
        assert res["plans"] == [2, 2, 2, 3]  # dp2 and pp2 once; pp2 again after the move
        assert res["same"]


def _distributed_optimizer() -> str:
    policy = _policy({"use_distributed_optimizer": True})
    with pytest.raises(ValueError, match="use_distributed_optimizer") as err:
        policy.move_master(DP2)
    assert policy.train_layout == TP2 and DP2 in policy.copies
    return str(err.value)


def test_move_master_refuses_distributed_optimizer():
    message = run_distributed(_distributed_optimizer, 2, timeout_s=60)[0]
    assert "DistributedOptimizer" in message and "supported" in message


@pytest.mark.parametrize("amsgrad", [False, True])
def test_init_adam_state_equals_lazy_initialisation(amsgrad: bool):
    """torch AdamW with state created up front steps bitwise like lazy initialisation."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(5, 3, generator=gen)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    lazy, eager = (torch.optim.AdamW([p], lr=1e-2, amsgrad=amsgrad) for p in params)
    init_adam_state(eager)
    assert eager.state[params[1]]["step"].dtype == torch.float32
    for _ in range(3):
        grad = torch.randn(5, 3, generator=gen)
        for p, opt in zip(params, (lazy, eager)):
            p.grad = grad.clone()
            opt.step()
    assert torch.equal(params[0], params[1])
    for key, value in lazy.state[params[0]].items():
        assert torch.equal(value, eager.state[params[1]][key]), key
