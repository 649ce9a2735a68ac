"""Training checkpoints: save/resume with megatron-core ``dist_checkpointing``, atomic, retained.

    save_checkpoint(cfg, step, ddp_chunks, optimizer, weight_version=v, data_state={...})
    state = load_checkpoint(cfg.dir, ddp_chunks, optimizer)    # follows 'latest'

``cfg`` is the run config's ``CheckpointConfig`` (``config.run``) with ``dir`` set. On disk
(``dir``), Megatron-LM's layout::

    iter_0000010/          a complete dist_checkpointing (torch_dist) directory + run_metadata.json
    iter_0000020.tmp/      a save in progress (or interrupted): ignored, removed by clean_incomplete
    latest                 "iter_0000010", replaced by atomic rename once a new directory is final
    latest_checkpointed_iteration.txt   "10": Megatron-LM's tracker, written the same way

Megatron-LM interop (``training/checkpoint_interop.py``): ``common.pt`` carries Megatron-LM's
``args`` (an ``argparse.Namespace``: parallel sizes, model shape, padded vocabulary, ...),
``iteration`` and ``checkpoint_version``, so Megatron-LM's loader reads our checkpoints; and
``load_checkpoint`` reads a checkpoint Megatron-LM wrote (its tracker, ``iter_*`` or ``release``
directory and ``args``: weights and iteration; its optimizer and RNG formats are not ours). A
config that does not describe the model being saved is refused before anything is written; a
checkpoint whose args do not describe the model loading it (another vocabulary padding rule or
TP for the rule, another shape) is refused naming both values and the config key that fixes it.

What a checkpoint holds: every model chunk's ``sharded_state_dict()`` (keys independent of the
layout), the Megatron optimizer's ``sharded_state_dict(model_sd)`` (plain optimizer: sharded like
the parameters; distributed optimizer: ``dp_reshardable`` or ``fully_reshardable``), each rank's RNG
states as one ``ShardedObject`` per rank (CPU generator, CUDA generator when present, Megatron's
tracker states, Python and NumPy), and in ``common.pt`` the step, weight version, data position,
layout and model config. ``run_metadata.json`` repeats the small facts for humans and tools.

Layouts: the model always loads in another layout (dist_checkpointing reshards). The plain
optimizer's state loads in any TP/PP/DP layout; the distributed optimizer's in any layout with
``fully_reshardable`` (Apex/TE Adam) and across DP sizes with ``dp_reshardable`` (the torch-Adam
fallback; another TP/PP is refused by name). RNG states are per rank and restored only in the same
layout and world size (``ResumeState.rng_restored`` says which happened). See
megatron_earl/docs/checkpoints.md for the megatron-core 0.16.1 details.

Atomicity: all ranks write into ``iter_N.tmp/``; rank 0 then fsyncs every file and the directory,
renames it to ``iter_N/``, and writes each tracker (``latest``, then Megatron-LM's) to a ``.tmp``
file, fsyncs and renames it over the tracker. A crash at any point leaves each tracker naming a
complete checkpoint (the previous one, or the new one). Retention keeps the last
``keep_last`` checkpoints (0: all) plus every step divisible by ``keep_every``.

``dist_checkpointing.save`` normally starts a *spawned* multiprocessing manager, which re-imports
``__main__`` (a script without an ``if __name__ == "__main__":`` guard hangs) and costs seconds;
``save_checkpoint`` hands it an in-process queue instead for its synchronous save (the patch
``patches/checkpoint_results_queue.py``). Keep the guard in scripts anyway: Megatron still forks
writers. Those writers die with their rank, even when it is killed mid-save
(``patches/checkpoint_writers_die_with_rank.py``).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatron_earl.config.run import CheckpointConfig
from megatron_earl.parallel.ddp import unwrap_chunk
from megatron_earl.parallel.groups import host_group
from megatron_earl.patches import (
    checkpoint_results_queue,
    checkpoint_writers_die_with_rank,
    cpu_redirect,
)
from megatron_earl.redistribute.optimizer_state import (
    init_adam_state,
    sub_optimizers,
    torch_optimizer,
)
from megatron_earl.training import checkpoint_interop as interop
from megatron_earl.training.setup import fuse_torch_adam

COMMON_KEY = "megatron_earl"
LATEST = "latest"
_PREFIX = "iter_"
# megatron-core 0.16's default distributed-optimizer format (fully_sharded_model_space) builds
# flattened ShardedTensors that its own validation rejects ("flattened_range is not supported"):
# config.run.DIST_OPT_FORMATS offers the two others.


class CheckpointError(ValueError):
    """A missing or unusable checkpoint; the message names the path."""


@dataclass
class ResumeState:
    """What a loaded checkpoint tells the training loop."""

    path: Path
    step: int
    weight_version: int
    data_state: dict[str, Any] = field(default_factory=dict)
    optimizer_restored: bool = False
    rng_restored: bool = False
    saved_layout: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- pure planning


def iter_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:07d}"


def retained_steps(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    """Steps to keep: the ``keep_last`` largest (0: all), plus multiples of ``keep_every`` (if
    > 0)."""
    kept = set(sorted(steps)[-keep_last:]) if keep_last > 0 else set(steps)
    if keep_every > 0:
        kept.update(s for s in steps if s % keep_every == 0)
    return kept


def complete_steps(save_dir: str | Path) -> list[int]:
    """Steps of the complete ``iter_*`` directories (``.tmp`` ones excluded), ascending."""
    out = []
    for p in Path(save_dir).glob(f"{_PREFIX}*"):
        tail = p.name[len(_PREFIX) :]
        if p.is_dir() and tail.isdigit():
            out.append(int(tail))
    return sorted(out)


def resolve_checkpoint(path: str | Path) -> Path:
    """The ``iter_*`` (or any dist_checkpointing) directory ``path`` names: itself, or for a save
    root the one its trackers name (``latest``, Megatron-LM's ``latest_checkpointed_iteration.txt``;
    the newer if they differ), falling back to the newest complete ``iter_*``."""
    p = Path(path)
    if (p / "metadata.json").is_file():
        return p
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    named = []
    for tracker, name in ((LATEST, _read(p / LATEST)), (interop.TRACKER, _tracked(p))):
        if name is None:
            continue
        if not (p / name / "metadata.json").is_file():
            raise CheckpointError(
                f"{p / tracker} names {p / name}, which is not a complete checkpoint"
            )
        named.append(p / name)
    if named:
        return max(named, key=lambda d: _step_of(d.name))
    steps = complete_steps(p)
    if steps:
        return p / iter_dir_name(steps[-1])
    raise CheckpointError(
        f"no checkpoint at {p}: expected a dist_checkpointing directory (metadata.json), a "
        f"'{LATEST}' or '{interop.TRACKER}' file, or {_PREFIX}NNNNNNN/ directories"
    )


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


def _tracked(save_dir: Path) -> str | None:
    """The directory Megatron-LM's tracker names, None without one."""
    text = _read(save_dir / interop.TRACKER)
    if text is None:
        return None
    name = interop.tracker_dir_name(text)
    if name is None:
        raise CheckpointError(
            f"{save_dir / interop.TRACKER} holds {text!r}: neither an iteration number nor "
            f"'{interop.RELEASE}'"
        )
    return name


def _step_of(name: str) -> int:
    """The step of an ``iter_*`` directory name; 0 for any other (Megatron-LM's ``release``)."""
    tail = name[len(_PREFIX) :]
    return int(tail) if name.startswith(_PREFIX) and tail.isdigit() else 0


# ----------------------------------------------------------------------------- file system


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def clean_incomplete(save_dir: str | Path) -> list[Path]:
    """Remove interrupted saves (``*.tmp`` entries) from ``save_dir``. Returns what was removed.

    Which ranks call: rank 0 only (or a single process), before the first save of a run.
    """
    removed = []
    root = Path(save_dir)
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        if p.name.endswith(".tmp") or ".tmp-" in p.name:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(p)
    return removed


def _publish(tmp: Path, final: Path, save_dir: Path) -> None:
    """Make ``tmp`` the checkpoint ``final`` and point both trackers at it (rank 0)."""
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_path(save_dir)
    _write_atomic(save_dir / LATEST, final.name + "\n")
    _write_atomic(save_dir / interop.TRACKER, str(_step_of(final.name)))  # as Megatron-LM writes


def _write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` through a fsynced ``.tmp`` file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _apply_retention(save_dir: Path, keep_last: int, keep_every: int, newest: int) -> None:
    steps = complete_steps(save_dir)
    keep = retained_steps(steps, keep_last, keep_every) | {newest}
    for step in steps:
        if step not in keep:
            shutil.rmtree(save_dir / iter_dir_name(step), ignore_errors=True)


# ----------------------------------------------------------------------------- state pieces


def _layout() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
        "world_size": dist.get_world_size(),
    }


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_object(data: Any):
    from megatron.core.dist_checkpointing import ShardedObject

    world, rank = dist.get_world_size(), dist.get_rank()
    return ShardedObject("rng_state", data, (world,), (rank,), replica_id=0)


@contextlib.contextmanager
def _allow_child_processes() -> Iterator[None]:
    """Let a daemonic process (e.g. a ``run_distributed`` rank) save: megatron-core's torch_dist
    writer forks one writer process per bucket and starts a multiprocessing manager, which
    ``multiprocessing`` refuses in daemonic processes. The writers are joined before ``save``
    returns, so the flag only matters during the call."""
    config = mp.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def _default_dist_opt_format() -> str:
    from megatron.core.optimizer import distrib_optimizer

    return "fully_reshardable" if distrib_optimizer.HAVE_APEX_OR_TE else "dp_reshardable"


def _is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(sub, DistributedOptimizer) for sub in sub_optimizers(optimizer))


def _check_optimizer_layout(ckpt: Path, info: dict[str, Any], optimizer: Any) -> None:
    """Refuse, with the reason, an optimizer state this layout cannot load."""
    saved = info.get("layout") or {}
    now = _layout()
    kind = "distributed" if _is_distributed(optimizer) else "plain"
    if info.get("optimizer_kind", kind) != kind:
        raise CheckpointError(
            f"{ckpt}: optimizer state of a {info['optimizer_kind']} optimizer cannot be loaded "
            f"into a {kind} one (use_distributed_optimizer must match, or load_optimizer=False)"
        )
    if info.get("dist_opt_format") == "dp_reshardable":
        moved = [a for a in ("tp", "cp", "pp", "vpp") if saved.get(a) != now[a]]
        if moved:
            raise CheckpointError(
                f"{ckpt}: distributed-optimizer state was saved as 'dp_reshardable' at "
                f"{ {a: saved.get(a) for a in moved} }, which reshards over DP only; this layout "
                f"has { {a: now[a] for a in moved} }. Load with load_optimizer=False, or save "
                "with dist_opt_format='fully_reshardable' (needs Apex/TE Adam) or the plain "
                "optimizer"
            )


@torch.no_grad()
def _init_empty_adam_state(optimizer: Any) -> None:
    """Give a fresh distributed optimizer's torch Adam (no Apex/TE) zero moments and step 0
    (``redistribute.optimizer_state.init_adam_state``): megatron-core 0.16.1 reads every
    parameter's ``step`` before it can describe the state to load
    (``DistributedOptimizer.state_dict``), which a never-stepped torch Adam does not have. The
    loaded checkpoint then overwrites the moments; ``_separate_adam_steps`` sets the
    step."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in sub_optimizers(optimizer):
        if isinstance(sub, DistributedOptimizer):
            init_adam_state(sub)


@torch.no_grad()
def _separate_adam_steps(optimizer: Any) -> None:
    """Give every parameter of a just-loaded distributed optimizer's torch Adam (the fallback
    without Apex/TE) its own ``step`` counter, set to the saved step.

    megatron-core 0.16.1 loads the saved step into the param groups (``group["step"]``), hands
    every parameter the same step tensor (copied per parameter only where torch's loader moves
    it to the parameter's device), then copies the template's step (0) into it
    (``load_parameter_state_from_dp_reshardable``). Left so, Adam restarted at step 0 after a
    resume and, where the counter stayed shared, torch advanced it once per parameter per
    update: Adam's bias correction was wrong from the resume on. Local."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in sub_optimizers(optimizer):
        adam = torch_optimizer(sub)
        if not isinstance(sub, DistributedOptimizer) or not isinstance(adam, torch.optim.Adam):
            continue  # TE/Apex FusedAdam keeps one step per group
        for group in adam.param_groups:
            for p in group["params"]:
                state = adam.state[p]
                state["step"] = torch.full_like(state["step"], float(group["step"]))


def _model_sharded_state_dict(chunks: list[nn.Module]) -> dict[str, Any]:
    """Every chunk's sharded state dict under Megatron-LM's key (``interop.model_key``)."""
    n = len(chunks)
    return {
        interop.model_key(i, n): unwrap_chunk(c).sharded_state_dict() for i, c in enumerate(chunks)
    }


# ----------------------------------------------------------------------------- save / load


def save_checkpoint(
    config: CheckpointConfig,
    step: int,
    model_chunks: list[nn.Module],
    optimizer: Any = None,
    *,
    weight_version: int = 0,
    data_state: dict[str, Any] | None = None,
    model_config: Any = None,
    family: str | None = None,
    run_metadata: dict[str, Any] | None = None,
) -> Path:
    """Save ``iter_<step>`` atomically under ``config.dir`` and apply retention.

    ``data_state`` (JSON-like, the same on every rank) is the data position to resume from.
    ``model_config`` (the config the model was built from) gives Megatron-LM's ``args`` the
    vocabulary and RoPE settings; when it does not describe the model (``interop.save_problems``)
    nothing is written and ``CheckpointError`` names each difference.
    Which ranks call: every rank of the world (``dist_checkpointing.save`` is collective).
    """
    from megatron.core.dist_checkpointing import serialization

    if config.dir is None:
        raise CheckpointError("CheckpointConfig.dir is None: nowhere to save")
    facts = interop.model_args(unwrap_chunk(model_chunks[0]))
    problems = interop.save_problems(facts, model_config)  # the same verdict on every rank
    if problems:
        raise CheckpointError(
            f"not saving step {step} to {config.dir}: the model config does not describe the "
            "model (the checkpoint's Megatron-LM args would be wrong): " + "; ".join(problems)
        )
    save_dir = Path(config.dir)
    final = save_dir / iter_dir_name(step)
    tmp = save_dir / f"{final.name}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        clean_incomplete(save_dir)  # interrupted earlier saves (one save runs at a time)
        tmp.mkdir()
    dist.barrier(group=host_group())  # file-system order only: the host world group
    layout = _layout()
    info = {
        "step": step,
        "weight_version": weight_version,
        "data_state": dict(data_state or {}),
        "layout": layout,
        "model_config": model_config.to_dict() if model_config is not None else None,
        "family": family,
    }
    state: dict[str, Any] = _model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        info["optimizer_kind"] = "distributed" if _is_distributed(optimizer) else "plain"
        if info["optimizer_kind"] == "distributed":
            info["dist_opt_format"] = config.dist_opt_format or _default_dist_opt_format()
        meta = {"distrib_optim_sharding_type": info.get("dist_opt_format")}
        with cpu_redirect.when_applied():
            state["optimizer"] = optimizer.sharded_state_dict(dict(state), metadata=meta)
    state["rng_state"] = _rng_object(_rng_state())
    state[COMMON_KEY] = info
    state["args"] = interop.megatron_lm_args(facts, model_config, layout, step)
    state["iteration"] = step
    state["checkpoint_version"] = interop.CHECKPOINT_VERSION
    started = time.time()
    with (
        _allow_child_processes(),
        checkpoint_results_queue.in_process_results_queue(),
        checkpoint_writers_die_with_rank.writers_die_with_rank(),
    ):
        serialization.save(state, str(tmp))  # ends with a barrier
    if rank == 0:
        meta = {
            **{k: v for k, v in info.items() if k != "model_config"},
            "model_config": info["model_config"],
            "saved_at_unix": started,
            "save_seconds": round(time.time() - started, 3),
            "has_optimizer": optimizer is not None,
            **(run_metadata or {}),
        }
        (tmp / "run_metadata.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        _publish(tmp, final, save_dir)
        _apply_retention(save_dir, config.keep_last, config.keep_every, step)
    dist.barrier(group=host_group())
    return final


def read_common(path: str | Path) -> dict[str, Any]:
    """This project's common metadata of a checkpoint (step, layout, ...); empty for one
    Megatron-LM wrote. Local."""
    return _common_pt(resolve_checkpoint(path)).get(COMMON_KEY, {})


def _common_pt(ckpt: Path) -> dict[str, Any]:
    """The whole ``common.pt`` (Megatron-LM's ``args``, ``iteration``, ours under
    ``COMMON_KEY``)."""
    return torch.load(ckpt / "common.pt", map_location="cpu", weights_only=False)


def load_checkpoint(
    path: str | Path,
    model_chunks: list[nn.Module],
    optimizer: Any = None,
    *,
    load_optimizer: bool = True,
    load_rng: bool = True,
    model_config: Any = None,
) -> ResumeState:
    """Load model (any layout), optimizer (if given, saved and ``load_optimizer``) and RNG
    (same layout only) from ``path`` (a run directory or one ``iter_*`` directory). A checkpoint
    Megatron-LM wrote gives the weights and its iteration (its optimizer and RNG formats are not
    ours). A checkpoint whose ``args`` do not describe these chunks (vocabulary padding, shape)
    raises ``CheckpointError`` naming both values and the config key that fixes it;
    ``model_config`` (the config the chunks were built from) names their padding rule there.

    Which ranks call: every rank of the world.
    """
    from megatron.core.dist_checkpointing import serialization

    ckpt = resolve_checkpoint(path)
    common = _common_pt(ckpt)
    info = common.get(COMMON_KEY, {})
    if common.get("args") is not None:  # the same verdict on every rank
        facts = interop.model_args(unwrap_chunk(model_chunks[0]))
        problems = interop.load_problems(
            common["args"], facts, model_config, info.get("model_config")
        )
        if problems:
            raise CheckpointError(f"{ckpt} does not fit this model: " + "; ".join(problems))
    ours = COMMON_KEY in common
    has_optimizer = any(k.startswith("optimizer.") for k in _tensor_keys(ckpt))
    want_optimizer = ours and optimizer is not None and load_optimizer and has_optimizer
    same_layout = info.get("layout") == _layout()
    want_rng = load_rng and same_layout
    state: dict[str, Any] = _model_sharded_state_dict(model_chunks)
    if want_optimizer:
        _check_optimizer_layout(ckpt, info, optimizer)
        _init_empty_adam_state(optimizer)
        meta = {"distrib_optim_sharding_type": info.get("dist_opt_format", "fully_reshardable")}
        with cpu_redirect.when_applied():
            state["optimizer"] = optimizer.sharded_state_dict(
                dict(state), is_loading=True, metadata=meta
            )
    if want_rng:
        state["rng_state"] = _rng_object(None)
    loaded = serialization.load(state, str(ckpt))
    for i, chunk in enumerate(model_chunks):
        unwrap_chunk(chunk).load_state_dict(loaded[interop.model_key(i, len(model_chunks))])
    if want_optimizer:
        with cpu_redirect.when_applied(), torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
            _separate_adam_steps(optimizer)
            fuse_torch_adam(optimizer)  # the saved groups' ``fused`` came back with them
    if want_rng:
        _set_rng_state(loaded["rng_state"])
    iteration = 0 if ckpt.name == interop.RELEASE else common.get("iteration", 0)
    return ResumeState(
        path=ckpt,
        step=int(info.get("step", iteration)),
        weight_version=int(info.get("weight_version", 0)),
        data_state=dict(info.get("data_state") or {}),
        optimizer_restored=want_optimizer,
        rng_restored=want_rng,
        saved_layout=dict(info.get("layout") or {}),
    )


def load_model_weights(
    model_chunks: list[nn.Module], path: str | Path, model_config: Any = None
) -> None:
    """Model weights only (e.g. an initial checkpoint, ours or Megatron-LM's). Which ranks call:
    every rank."""
    load_checkpoint(
        path, model_chunks, None, load_optimizer=False, load_rng=False, model_config=model_config
    )


def _tensor_keys(ckpt: Path) -> list[str]:
    from megatron_earl.convert.dcp import check_checkpoint

    return list(check_checkpoint(ckpt))
