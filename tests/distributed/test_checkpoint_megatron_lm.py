"""Megatron-LM checkpoint interop, both ways (``training/checkpoint_interop.py``), on gloo:

- a checkpoint laid out as Megatron-LM (core_v0.16.1 ``megatron/training/checkpointing.py``)
  writes it -- ``latest_checkpointed_iteration.txt``, ``iter_0000007/`` from megatron-core's
  ``dist_checkpointing.save`` of ``{"model", "args", "iteration", "checkpoint_version",
  "rng_state"}``, the vocabulary padded by Megatron-LM's rule at TP2 (100 -> 112 with
  ``--make-vocab-size-divisible-by 8``; 104 by ours) -- loads here with
  ``model.vocab_padding: megatron-lm``, ``vocab_padding_tp: 2``: at TP2 the logits equal the
  writer's bitwise (the same shards, the same sums), at TP1 within the fp32 bound of a forward's
  sums in another order (``tests/tolerances.py``: ~8e2 terms, ~1e-4 x max |logit|);
- ours loads through the code path Megatron-LM uses: its tracker, ``common.pt``'s ``args``
  (the model built from them, the vocabulary padded by Megatron-LM's rule at the loading TP),
  ``dist_checkpointing.load`` of the model's sharded state dict under ``model``: at TP2 bitwise,
  at TP1 (``--make-vocab-size-divisible-by 16``, so 16 x 1 pads 100 to the same 112) within the
  same bound;
- bad input: another padding rule, or Megatron-LM's rule at another TP, is refused naming both
  row counts, both rules and the settings that fix it; a save whose config does not describe its
  model writes nothing (no tracker, no ``iter_*``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.run import CheckpointConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from megatron_earl.training.checkpoint import CheckpointError, resolve_checkpoint
from tests.tolerances import assert_fp32_close, gpt_terms

VOCAB = 100
SHAPE = dict(
    num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2
)
MODEL = ModelConfig(
    **SHAPE,
    vocab_size=VOCAB,
    make_vocab_size_divisible_by=8,
    vocab_padding="megatron-lm",
    vocab_padding_tp=2,
)
"""The config here: Megatron-LM's padding at TP2, 112 rows in every layout."""
EARL = ModelConfig(**SHAPE, vocab_size=VOCAB, make_vocab_size_divisible_by=8)  # 104 rows
TP4_RULE = ModelConfig(**{**MODEL.to_dict(), "vocab_padding_tp": 4})  # 128 rows
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
FORWARD_TERMS = gpt_terms(MODEL, 16)
ITERATION = 7


def _megatron_lm_rows(divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding`` (tokenizer.py): a multiple of divisor x TP."""
    multiple = divisible_by * tp
    return math.ceil(VOCAB / multiple) * multiple


def _model(config: ModelConfig, seed: int):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model

    runtime.seed(seed)
    return build_model(config)


def _megatron_lm_model(args: argparse.Namespace, rows: int, seed: int):
    """The model Megatron-LM builds from ``args`` (its ``model_provider``: a GPTModel of the
    args' shape and ``rows`` vocabulary rows; the rows alone, no padding rule of ours)."""
    config = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        vocab_size=rows,
        make_vocab_size_divisible_by=1,
        max_position_embeddings=args.max_position_embeddings,
        rotary_base=float(args.rotary_base),
        norm_epsilon=args.layernorm_epsilon,
        tie_embeddings=not args.untie_embeddings_and_output_weights,
    )
    return _model(config, seed)


def _logits(chunks) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_earl.training.schedule import forward_backward

    def fn(logits, batch):
        full = gather_from_tensor_model_parallel_region(logits.float())
        return full.sum() * 0.0, {"logits": full.detach().clone()}

    batch = {"tokens": TOKENS, "position_ids": torch.arange(16).expand(2, -1).contiguous()}
    return forward_backward(chunks, [batch], fn, forward_only=True)[0]["logits"]


def _write_megatron_lm_checkpoint(root: str) -> torch.Tensor:
    """Save as Megatron-LM's ``save_checkpoint`` does with ``--ckpt-format torch_dist
    --no-save-optim`` at TP2; returns the model's logits. Every rank calls."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedObject, serialization

    from megatron_earl.patches import checkpoint_results_queue
    from megatron_earl.training.checkpoint import _allow_child_processes

    tp, rows = ps.get_tensor_model_parallel_world_size(), _megatron_lm_rows(8, 2)
    args = argparse.Namespace(  # Megatron-LM's names, as its parser and validate_args leave them
        **{k: v for k, v in SHAPE.items()},
        group_query_attention=True,
        kv_channels=8,
        vocab_size=None,  # Megatron-LM takes it from the tokenizer
        make_vocab_size_divisible_by=8,
        padded_vocab_size=rows,
        max_position_embeddings=4096,
        position_embedding_type="rope",
        add_position_embedding=True,
        rotary_base=10000,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        ckpt_format="torch_dist",
        no_save_optim=True,
        no_save_rng=False,
        iteration=ITERATION,
    )
    chunk = _megatron_lm_model(args, rows, seed=21)[0]
    rng = {"random_rng_state": None, "torch_rng_state": torch.get_rng_state()}
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": chunk.sharded_state_dict(),
        "rng_state": ShardedObject(
            "rng_state",
            [rng],
            (1, tp),
            (0, ps.get_tensor_model_parallel_rank()),
            replica_id=ps.get_data_parallel_rank(),
        ),
        "num_floating_point_operations_so_far": 0,
    }
    ckpt = Path(root) / f"iter_{ITERATION:07d}"
    if torch.distributed.get_rank() == 0:
        ckpt.mkdir(parents=True)
    torch.distributed.barrier()
    with _allow_child_processes(), checkpoint_results_queue.in_process_results_queue():
        serialization.save(state, str(ckpt))
    if torch.distributed.get_rank() == 0:  # the tracker last, as Megatron-LM's finalize does
        (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    torch.distributed.barrier()
    return _logits([chunk])


def _megatron_lm_load(root: str, divisible_by: int) -> tuple[torch.Tensor, int]:
    """Megatron-LM's ``load_checkpoint`` for a torch_dist checkpoint, model only: the tracker,
    ``load_common_state_dict`` for ``args`` / ``iteration`` / ``checkpoint_version``, its
    ``check_checkpoint_args``, a model from the args with the vocabulary padded by its rule at
    this TP (``divisible_by`` = ``--make-vocab-size-divisible-by``), ``dist_checkpointing.load``
    of ``{"model": sharded_state_dict()}``. Returns the logits and the iteration."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import load_common_state_dict, serialization

    tracker = (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    ckpt = str(Path(root) / f"iter_{int(tracker):07d}")
    common = load_common_state_dict(ckpt)
    args = common["args"]
    assert isinstance(args, argparse.Namespace) and common["checkpoint_version"] == 3.0
    for name in ("num_layers", "hidden_size", "num_attention_heads"):  # check_checkpoint_args
        assert getattr(args, name) == SHAPE[name], name
    assert args.no_save_rng and args.no_save_optim  # its loader then skips RNG and optimizer
    rows = _megatron_lm_rows(divisible_by, ps.get_tensor_model_parallel_world_size())
    chunk = _megatron_lm_model(args, rows, seed=41)[0]
    loaded = serialization.load({"model": chunk.sharded_state_dict()}, ckpt)
    chunk.load_state_dict(loaded["model"])
    return _logits([chunk]), common["iteration"]


def _refusal(root: str, config: ModelConfig) -> str:
    from megatron_earl.training.checkpoint import load_checkpoint

    try:
        load_checkpoint(root, _model(config, 11), model_config=config)
    except CheckpointError as err:
        return str(err)
    raise AssertionError(f"{config.padded_vocab_size} rows loaded a 112-row checkpoint")


def _tp2(ml_root: str, our_root: str, bad_root: str) -> dict:
    """TP2: write Megatron-LM's checkpoint and load it here; save ours and load it Megatron-LM's
    way; the refusals."""
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.training.checkpoint import load_checkpoint, save_checkpoint

    use_layout(ParallelLayout(tp=2))
    out = {"ml_logits": _write_megatron_lm_checkpoint(ml_root)}
    chunks = _model(MODEL, 11)
    state = load_checkpoint(ml_root, chunks, model_config=MODEL)
    out |= {"loaded_ml": _logits(chunks), "step": state.step, "opt": state.optimizer_restored}
    out["refusals"] = [_refusal(ml_root, EARL), _refusal(ml_root, TP4_RULE)]

    ours = _model(MODEL, 31)
    save_checkpoint(CheckpointConfig(dir=our_root), 3, ours, model_config=MODEL)
    out["our_logits"] = _logits(ours)
    out["ml_loaded_ours"], out["ml_iteration"] = _megatron_lm_load(our_root, divisible_by=8)
    try:  # a config that does not describe the model: the checkpoint's args would lie
        save_checkpoint(CheckpointConfig(dir=bad_root), 5, ours, model_config=EARL)
    except CheckpointError as err:
        out["bad_save"] = str(err)
    return out


def _tp1(ml_root: str, our_root: str) -> dict:
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.training.checkpoint import load_checkpoint

    use_layout(ParallelLayout())
    chunks = _model(MODEL, 11)
    load_checkpoint(ml_root, chunks, model_config=MODEL)
    loaded_ours, _ = _megatron_lm_load(our_root, divisible_by=16)
    return {"loaded_ml": _logits(chunks), "ml_loaded_ours": loaded_ours}


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    roots = [str(tmp_path_factory.mktemp(n)) for n in ("megatron-lm", "ours", "bad")]
    return roots, run_distributed(_tp2, 2, args=tuple(roots), timeout_s=240)[0]


def test_megatron_lm_checkpoint_loads_at_tp2_and_tp1(tp2_run):
    (ml_root, our_root, _), res = tp2_run
    assert torch.equal(res["loaded_ml"], res["ml_logits"])  # same layout: bitwise
    assert res["loaded_ml"].shape[-1] == 112 and res["step"] == ITERATION and not res["opt"]
    assert resolve_checkpoint(ml_root).name == "iter_0000007"
    tp1 = run_distributed(_tp1, 1, args=(ml_root, our_root), timeout_s=180)[0]
    assert_fp32_close(tp1["loaded_ml"], res["ml_logits"], FORWARD_TERMS)
    # ours, read the way Megatron-LM reads it, at TP1 with a divisor that pads to the same rows
    assert_fp32_close(tp1["ml_loaded_ours"], res["our_logits"], FORWARD_TERMS)


def test_ours_loads_through_megatron_lm_code_path(tp2_run):
    (_, our_root, _), res = tp2_run
    assert torch.equal(res["ml_loaded_ours"], res["our_logits"]) and res["ml_iteration"] == 3
    root = Path(our_root)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (root / "latest").read_text().strip() == "iter_0000003"
    common = torch.load(root / "iter_0000003" / "common.pt", weights_only=False)
    args = common["args"]
    assert common["iteration"] == 3 and common["checkpoint_version"] == 3.0
    assert isinstance(args, argparse.Namespace)
    got = {k: getattr(args, k) for k in ("tensor_model_parallel_size", "padded_vocab_size")}
    assert got == {"tensor_model_parallel_size": 2, "padded_vocab_size": 112}
    assert (args.make_vocab_size_divisible_by, args.vocab_size, args.iteration) == (8, VOCAB, 3)
    assert (args.num_query_groups, args.kv_channels, args.ffn_hidden_size) == (2, 8, 64)


def test_padding_rule_or_tp_mismatch_is_refused_by_name(tp2_run):
    _, res = tp2_run
    earl, tp4 = res["refusals"]
    for msg in (earl, tp4):  # both row counts, the checkpoint's rule, the settings that fix it
        assert "checkpoint 112 rows" in msg and "tensor_model_parallel_size 2" in msg, msg
        assert "set model.vocab_padding=megatron-lm model.vocab_padding_tp=2" in msg, msg
    mine = "this model {} (vocab_size 100 padded to a multiple of make_vocab_size_divisible_by 8"
    assert mine.format(104) + ");" in earl, earl
    assert mine.format(128) + " x vocab_padding_tp 4 (Megatron-LM's rule));" in tp4, tp4


def test_failed_interop_check_writes_nothing(tp2_run):
    (_, _, bad_root), res = tp2_run
    msg = res["bad_save"]
    assert "pads vocab_size 100 to 104" in msg and "has 112 rows" in msg, msg
    assert not list(Path(bad_root).iterdir())  # no tracker, no iter_*, no .tmp


def test_megatron_lm_tracker_grammar(tmp_path):
    for name in ("iter_0000004", "release"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text("{}")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert resolve_checkpoint(tmp_path).name == "release"
    (tmp_path / "latest").write_text("iter_0000004\n")  # both trackers: the newer
    assert resolve_checkpoint(tmp_path).name == "iter_0000004"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4x")
    with pytest.raises(CheckpointError, match="'4x': neither an iteration number nor 'release'"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(CheckpointError, match="iter_0000009, which is not a complete"):
        resolve_checkpoint(tmp_path)
