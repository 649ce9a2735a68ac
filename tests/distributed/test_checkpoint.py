"""Training checkpoints (``training/checkpoint.py``) with real dist_checkpointing on gloo:

- saved at TP2, the model loads at TP1, DP2 and PP2 with the same logits and the optimizer state
  loads there too: the next step's loss equals the TP2 run's (within the fp32 bound of a forward's
  sums in another order: ``tests/tolerances.py``);
- resume in the same layout (TP2, dropout on) restores optimizer + RNG + data position: the next
  steps' losses equal an uninterrupted run bitwise;
- a save that fails after writing its files leaves ``latest`` on the previous checkpoint, the
  ``.tmp`` directory is ignored and cleaned;
- the distributed optimizer (torch-Adam fallback, 'dp_reshardable' state) resumes at DP2 (bitwise)
  and DP1 (within the fp32 bounds) with the uninterrupted run's next three losses (each parameter
  its own Adam step counter) and refuses another TP with a message naming both;
- retention keeps the last K plus every N-th; a missing path is a clear error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.run import CheckpointConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from megatron_earl.training.checkpoint import (
    CheckpointError,
    clean_incomplete,
    complete_steps,
    iter_dir_name,
    resolve_checkpoint,
    retained_steps,
)
from tests.tolerances import ADAM_EPS, adam_loss_tol, assert_fp32_close, gpt_terms

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=100,
    make_vocab_size_divisible_by=16,
)
DROPOUT_MODEL = ModelConfig(**{**MODEL.to_dict(), "attention_dropout": 0.1, "hidden_dropout": 0.1})
TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
LR = 1e-2
FORWARD_TERMS = gpt_terms(MODEL, 16)
"""Logits and a step's loss: a forward's chain of fp32 sums (~8e2 terms: ~1e-4 x magnitude)."""
GRAD_TERMS = gpt_terms(MODEL, 16, grad_tokens=2 * 2 * 16)
"""A gradient's (_batches: 2 micro-batches of 2 x 16 tokens)."""


def _loss_tol(loss: float, steps: int) -> float:
    """A loss ``steps`` optimizer steps after the runs' weights were the same (~5e-4 + 4e-4 per
    step here); lost Adam moments or step counts move the next losses by O(0.1)."""
    return adam_loss_tol(loss, FORWARD_TERMS, GRAD_TERMS, LR, steps)


def _batches(step: int):
    from megatron_earl.training.step import synthetic_lm_batches

    return synthetic_lm_batches(
        100, num_micro_batches=2, micro_batch_size=2, seq_length=16, seed=100 + step
    )


def _setup(layout: ParallelLayout, model: ModelConfig, distributed_optimizer: bool = False):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.training.setup import (
        OptimConfig,
        build_optimizer,
        wire_schedule_hooks,
        wrap_ddp,
    )

    use_layout(layout)
    runtime.seed(11)
    chunks = build_model(model, vpp=layout.vpp)
    optim = OptimConfig(lr=LR, adam_eps=ADAM_EPS, use_distributed_optimizer=distributed_optimizer)
    ddp = wrap_ddp(chunks, optim)
    optimizer = build_optimizer(ddp, optim)
    wire_schedule_hooks(ddp, optimizer)
    return ddp, optimizer


def _step(ddp, optimizer, step: int) -> float:
    """One train step on this DP rank's share of batch ``step``; the global mean loss."""
    from megatron.core import parallel_state as ps

    from megatron_earl.training.step import train_step

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    loss = train_step(ddp, optimizer, _batches(step)[dp_rank::dp])["loss"]
    reports = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    t = torch.tensor([loss if reports else 0.0], dtype=torch.float64)
    torch.distributed.all_reduce(t)  # one reporting rank per DP rank
    return float(t) / dp


def _logits(ddp):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_earl.training.schedule import forward_backward

    def fn(logits, batch):
        full = gather_from_tensor_model_parallel_region(logits.float())
        return full.sum() * 0.0, {"logits": full.detach().clone()}

    batch = {"tokens": TOKENS, "position_ids": torch.arange(16).expand(2, -1).contiguous()}
    metrics = forward_backward(ddp, [batch], fn, forward_only=True)
    return metrics[0]["logits"] if metrics else None


def _save_then_step(save_dir: str):
    """TP2: one step, save (step 1), logits, one more step (its loss is the reference)."""
    from megatron_earl.training.checkpoint import save_checkpoint

    ddp, optimizer = _setup(ParallelLayout(tp=2), MODEL)
    _step(ddp, optimizer, 0)
    save_checkpoint(CheckpointConfig(dir=save_dir), 1, ddp, optimizer, model_config=MODEL)
    return {"logits": _logits(ddp), "next_loss": _step(ddp, optimizer, 1)}


def _load_then_step(save_dir: str, layout: ParallelLayout):
    from megatron_earl.training.checkpoint import load_checkpoint

    ddp, optimizer = _setup(layout, MODEL)
    state = load_checkpoint(save_dir, ddp, optimizer)
    logits = _logits(ddp)
    return {
        "logits": logits,
        "next_loss": _step(ddp, optimizer, state.step),
        "optimizer": state.optimizer_restored,
        "rng": state.rng_restored,
    }


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("ckpt-tp2"))
    return save_dir, run_distributed(_save_then_step, 2, args=(save_dir,), timeout_s=180)[0]


@pytest.mark.parametrize(
    "layout", [ParallelLayout(), ParallelLayout(dp=2), ParallelLayout(pp=2)], ids=str
)
def test_tp2_checkpoint_loads_in_other_layouts(tp2_checkpoint, layout):
    save_dir, ref = tp2_checkpoint
    results = run_distributed(
        _load_then_step, layout.world_size, args=(save_dir, layout), timeout_s=180
    )
    for res in results:
        assert res["optimizer"] and not res["rng"]  # RNG only in the same layout
        if res["logits"] is not None:
            assert_fp32_close(res["logits"], ref["logits"], FORWARD_TERMS)
        # the loss of the loaded weights' forward (the step updates them after it)
        loss_tol = _loss_tol(ref["next_loss"], steps=0)
        assert abs(res["next_loss"] - ref["next_loss"]) <= loss_tol, (res["next_loss"], ref)


def _distopt_save(save_dir: str) -> list[float]:
    """DP2, distributed optimizer: two steps, save (Adam at step 2), then three more steps."""
    from megatron_earl.training.checkpoint import save_checkpoint

    ddp, optimizer = _setup(ParallelLayout(dp=2), MODEL, distributed_optimizer=True)
    for step in range(2):
        _step(ddp, optimizer, step)
    save_checkpoint(CheckpointConfig(dir=save_dir), 2, ddp, optimizer)
    return [_step(ddp, optimizer, step) for step in range(2, 5)]


def _distopt_load(save_dir: str, layout: ParallelLayout):
    from megatron_earl.redistribute.optimizer_state import sub_optimizers, torch_optimizer
    from megatron_earl.training.checkpoint import load_checkpoint
    from megatron_earl.training.rl_step import _grads_finite

    ddp, optimizer = _setup(layout, MODEL, distributed_optimizer=True)
    try:
        state = load_checkpoint(save_dir, ddp, optimizer)
    except CheckpointError as err:
        return str(err)
    assert state.optimizer_restored
    steps = [
        s["step"] for sub in sub_optimizers(optimizer) for s in torch_optimizer(sub).state.values()
    ]
    assert len({id(t) for t in steps}) == len(steps), "parameters share one step counter"
    assert {float(t) for t in steps} == {2.0}, steps
    losses = [_step(ddp, optimizer, step) for step in range(state.step, state.step + 3)]
    assert _grads_finite(ddp)  # the distributed optimizer's padded, reduce-scattered buffers
    return losses


def test_distributed_optimizer_reshards_over_dp(tmp_path):
    """Torch-Adam fallback (no Apex/TE): the distributed optimizer's state is saved as
    'dp_reshardable': it loads at the same and at another DP size, and the three steps after
    the resume equal the uninterrupted run's (the 2nd and 3rd depend on Adam's moments and step
    count); another TP is refused by name."""
    ref = run_distributed(_distopt_save, 2, args=(str(tmp_path),), timeout_s=180)[0]
    for layout in (ParallelLayout(dp=2), ParallelLayout()):
        resumed = run_distributed(
            _distopt_load, layout.world_size, args=(str(tmp_path), layout), timeout_s=120
        )[0]
        if layout.dp == 2:  # the same layout and state: the same sums in the same order
            assert resumed == ref, (resumed, ref)
            continue
        for step, (got, want) in enumerate(zip(resumed, ref, strict=True)):
            # DP1 sums the gradients in another order: losses after `step` updates
            assert abs(got - want) <= _loss_tol(want, step), (step, got, want)
    tp2 = run_distributed(
        _distopt_load, 2, args=(str(tmp_path), ParallelLayout(tp=2)), timeout_s=120
    )
    assert "'dp_reshardable'" in tp2[0] and "{'tp': 2}" in tp2[0], tp2[0]


def _train(save_dir: str, steps: int, save_at: int | None, resume: bool):
    """TP2 with dropout: train ``steps`` steps (data position = step), saving after ``save_at``."""
    from megatron_earl.training.checkpoint import load_checkpoint, save_checkpoint

    ddp, optimizer = _setup(ParallelLayout(tp=2), DROPOUT_MODEL)
    start, restored = 0, None
    if resume:
        state = load_checkpoint(save_dir, ddp, optimizer)
        start, restored = state.data_state["next_batch"], state
    losses = {}
    for step in range(start, steps):
        losses[step] = _step(ddp, optimizer, step)
        if save_at is not None and step + 1 == save_at:
            save_checkpoint(
                CheckpointConfig(dir=save_dir),
                step + 1,
                ddp,
                optimizer,
                weight_version=step + 1,
                data_state={"next_batch": step + 1},
            )
    if restored is not None:
        assert restored.optimizer_restored and restored.rng_restored
        assert restored.step == restored.weight_version == save_at
    return losses


def test_resume_same_layout_continues_bitwise(tmp_path):
    full = run_distributed(_train, 2, args=(str(tmp_path), 4, 2, False), timeout_s=180)[0]
    resumed = run_distributed(_train, 2, args=(str(tmp_path), 4, 2, True), timeout_s=180)[0]
    assert sorted(resumed) == [2, 3]
    for step, loss in resumed.items():
        assert loss == full[step], (step, loss, full[step])  # bitwise
    # Without restoring RNG the dropout masks differ: the comparison is meaningful.
    assert full[2] != full[1]


def _crash_mid_save(save_dir: str):
    """Save step 1; make step 2's save fail after its files are written; then resume."""
    from megatron_earl.training import checkpoint

    ddp, optimizer = _setup(ParallelLayout(), MODEL)
    cfg = CheckpointConfig(dir=save_dir)
    checkpoint.save_checkpoint(cfg, 1, ddp, optimizer)
    original = checkpoint._publish

    def crash(tmp, final, root):
        raise RuntimeError("simulated crash after writing the checkpoint files")

    checkpoint._publish = crash
    try:
        checkpoint.save_checkpoint(cfg, 2, ddp, optimizer)
    except RuntimeError as err:
        crashed = str(err)
    finally:
        checkpoint._publish = original
    root = Path(save_dir)
    tmp_files = sorted(p.name for p in (root / "iter_0000002.tmp").iterdir())
    latest = (root / "latest").read_text().strip()
    resolved = resolve_checkpoint(save_dir).name
    state = checkpoint.load_checkpoint(save_dir, ddp, optimizer)
    removed = [p.name for p in clean_incomplete(save_dir)]
    return crashed, tmp_files, latest, resolved, state.step, removed, complete_steps(save_dir)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    crashed, tmp_files, latest, resolved, step, removed, steps = run_distributed(
        _crash_mid_save, 1, args=(str(tmp_path),), timeout_s=120
    )[0]
    assert "simulated crash" in crashed
    assert "metadata.json" in tmp_files  # the failed save had written everything
    assert latest == resolved == iter_dir_name(1) and step == 1
    assert removed == ["iter_0000002.tmp"] and steps == [1]


def test_retention_keeps_last_k_and_every_nth(tmp_path):
    from megatron_earl.training.checkpoint import _apply_retention

    assert retained_steps([1, 2, 3, 4, 5, 6], keep_last=2, keep_every=3) == {3, 5, 6}
    assert retained_steps([10, 20, 30], keep_last=1, keep_every=0) == {30}
    assert retained_steps([], keep_last=2, keep_every=5) == set()
    for step in (100, 200, 300, 400, 500):
        (tmp_path / iter_dir_name(step)).mkdir()
    (tmp_path / "iter_0000600.tmp").mkdir()  # in progress: never counted or removed here
    _apply_retention(tmp_path, keep_last=2, keep_every=200, newest=500)
    assert complete_steps(tmp_path) == [200, 400, 500]
    assert (tmp_path / "iter_0000600.tmp").exists()
    assert retained_steps([1, 2, 3], keep_last=0, keep_every=0) == {1, 2, 3}  # 0 keeps all
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig(dir=str(tmp_path), keep_last=-1)


def test_missing_checkpoint_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(CheckpointError, match=str(missing)):
        resolve_checkpoint(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*empty"):
        resolve_checkpoint(tmp_path / "empty")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").write_text("iter_0000007\n")
    with pytest.raises(CheckpointError, match="iter_0000007"):
        resolve_checkpoint(tmp_path / "run")
