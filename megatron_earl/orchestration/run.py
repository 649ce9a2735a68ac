"""A whole run on this rank: resume or warm start, evaluate, RL steps, checkpoints, evaluate.

    summary = train(config)      # every rank; the same summary everywhere

Resume: when the run's checkpoint directory holds a complete checkpoint, the model, optimizer,
RNG states, step and weight version are restored and the run continues at the next step; the
warm start and the first evaluation are skipped (their results are in the checkpoint). Prompts of
step k are a pure function of k, so the resumed steps see the same data as an uninterrupted run;
sampling seeds are per step, so they generate the same tokens.

Reference policy (``train.loss.kl_coef > 0``): the initial policy, i.e. the weights after
``checkpoint.load`` and the warm start, frozen before the first RL step and saved once (weights
only) under ``<checkpoint_dir>/reference``; a resumed run loads it from there, so the KL term keeps
pointing at the same policy.

Start from existing weights: ``checkpoint.load`` names a Hugging Face model directory or a Megatron
checkpoint (saved in any layout); only the weights are loaded, then warm start and RL as usual.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_earl import runtime
from megatron_earl.config.run import CheckpointConfig, RunConfig
from megatron_earl.config.vocab import Activity, Phase
from megatron_earl.convert.families import family_for_model
from megatron_earl.orchestration.loop import RLLoop
from megatron_earl.orchestration.metrics import MetricsLogger
from megatron_earl.orchestration.progress import ProgressBar
from megatron_earl.orchestration.signals import StopSignal
from megatron_earl.orchestration.watchdog import Heartbeat
from megatron_earl.parallel.groups import host_group
from megatron_earl.parallel.state import use_layout
from megatron_earl.tokenizer import build_tokenizer
from megatron_earl.training import checkpoint as ckpt


def checkpoint_config(config: RunConfig) -> CheckpointConfig:
    """The run's checkpoint settings with the directory resolved (``RunConfig.checkpoint_dir``)."""
    return dataclasses.replace(config.checkpoint, dir=str(config.checkpoint_dir))


def _resume_source(config: RunConfig) -> str | None:
    """The run's own newest checkpoint, when resuming is on and one exists."""
    if config.checkpoint.resume and ckpt.complete_steps(config.checkpoint_dir):
        return str(config.checkpoint_dir)
    return None


def train(
    config: RunConfig, heartbeat: Heartbeat | None = None, stop: StopSignal | None = None
) -> dict[str, Any]:
    """Run ``config`` to ``config.steps``; returns the before/after evaluation summary.

    ``heartbeat``: told what the run is doing (the watchdog reports it; ``orchestration.
    watchdog``). ``stop`` (``checkpoint.on_signal``): at every step boundary the ranks agree
    whether a signal came; if so they save a checkpoint and return at once (no final
    evaluation), with ``summary["stopped_by_signal"]``."""
    heartbeat = heartbeat or Heartbeat()
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"device: {runtime.describe_policy()}", flush=True)
    tokenizer = build_tokenizer(config.tokenizer)
    loop = RLLoop(config, tokenizer, heartbeat)
    use_layout(loop.layouts[Phase.TRAIN])
    policy = loop.policy
    saving = checkpoint_config(config)
    summary: dict[str, Any] = {}

    source = _resume_source(config)
    if source is not None:
        if rank0:
            ckpt.clean_incomplete(config.checkpoint_dir)
        dist.barrier(group=host_group())
        state = ckpt.load_checkpoint(
            source, policy.ddp_chunks, policy.optimizer, model_config=config.model
        )
        loop.step = int(state.data_state.get("step", state.step))
        policy.version = state.weight_version
        if loop.selection is not None and state.data_state.get("selector"):
            loop.selection.restore(state.data_state["selector"])
            # continue as the uninterrupted run would: the rollout decision plans from the last
            # batch's lengths, and evaluation generates in the last rollout layout
            loop.last_lengths = list(state.data_state.get("last_lengths", []))
            for phase, selector in loop.selection.selectors.items():
                loop.active[phase] = selector.current.get(phase, loop.active[phase])
        summary.update(state.data_state.get("summary", {}))
        if loop.reference is not None:
            _load_reference(loop, config)
    else:
        if config.checkpoint.load:
            # Initial weights only (a Hugging Face directory or a Megatron checkpoint, any
            # layout); the run starts at step 0 with a fresh optimizer.
            from megatron_earl.convert.initial import load_initial_weights

            kind = load_initial_weights(
                policy.ddp_chunks, config.checkpoint.load, model_config=config.model
            )
            summary["initial_weights"] = f"{kind}:{config.checkpoint.load}"
        if config.sft.steps:
            with heartbeat.activity(Activity.SFT):
                loop.warm_start()
        if loop.reference is not None:
            loop.freeze_reference()
            _save_reference(loop, config)
        if config.eval.num_prompts:
            summary["before"] = _evaluate(loop, config)
            if rank0:
                print(f"eval before RL: {summary['before']}", flush=True)

    logger = MetricsLogger(
        config.run_dir,
        jsonl=config.logging.jsonl,
        tensorboard=config.logging.tensorboard,
        tensorboard_dir=config.tensorboard_dir,
        enabled=rank0,
        resume_step=loop.step if source is not None else None,
    )
    bar = ProgressBar(
        config.steps,
        start_step=loop.step,
        enabled=rank0 and config.logging.progress,
        log_interval=config.logging.log_interval,
    )
    if loop.selection is not None and config.selector.profile and not loop.selection.points:
        for line in loop.profile():
            if rank0:
                print(line, flush=True)
    with logger:
        while loop.step < config.steps:
            heartbeat.step = loop.step + 1
            heartbeat.set(Activity.STEP)
            metrics = loop.run_step()
            if config.eval.interval and loop.step % config.eval.interval == 0:
                metrics.update(_evaluate(loop, config))
            record = logger.log(loop.step, metrics)
            bar.update(loop.step, record)
            saved = bool(saving.interval) and loop.step % saving.interval == 0
            if saved:
                _save(loop, saving, config, summary)
            if stop is not None and stop.agreed():
                if not saved:
                    _save(loop, saving, config, summary)
                summary["stopped_by_signal"] = stop.stopped_by
                if rank0:
                    print(
                        f"stopped by {stop.stopped_by} after step {loop.step}: checkpoint "
                        f"saved in {config.checkpoint_dir}",
                        flush=True,
                    )
                break
        bar.close()
    heartbeat.set(Activity.SHUTDOWN)
    loop.stop_async()
    if "stopped_by_signal" not in summary:
        if config.eval.num_prompts:
            summary["after"] = _evaluate(loop, config)
            if rank0:
                print(f"eval after RL: {summary['after']}", flush=True)
        if saving.interval == 0 or loop.step % saving.interval:
            _save(loop, saving, config, summary)
    loop.backend.close()
    summary["steps"] = loop.step
    return summary


def reference_dir(config: RunConfig) -> Path:
    """Where a run keeps its reference policy's weights (one weights-only checkpoint)."""
    return config.checkpoint_dir / "reference"


def _save_reference(loop: RLLoop, config: RunConfig) -> None:
    """Save the frozen reference weights (any layout loads them). Every rank calls."""
    with loop.reference.in_layout():
        ckpt.save_checkpoint(
            CheckpointConfig(dir=str(reference_dir(config)), keep_last=1),
            0,
            loop.reference.chunks,
            weight_version=loop.policy.version,
            model_config=config.model,
            family=family_for_model(config.model).name,
        )


def _load_reference(loop: RLLoop, config: RunConfig) -> None:
    """Load the reference weights saved at the start of the run. Every rank calls."""
    path = reference_dir(config)
    if not ckpt.complete_steps(path):
        raise ckpt.CheckpointError(
            f"train.loss.kl_coef={config.train.loss.kl_coef} needs the reference policy saved "
            f"at the start of the run in {path}, but there is none (did the run start with "
            "kl_coef=0?); resume with train.loss.kl_coef=0, or start a new run with "
            f"checkpoint.load={config.checkpoint_dir} to use the resumed weights as reference"
        )
    with loop.reference.in_layout():
        ckpt.load_model_weights(loop.reference.chunks, path, model_config=config.model)
    loop.reference.loaded = True


def _evaluate(loop: RLLoop, config: RunConfig) -> dict[str, float]:
    e = config.eval
    with loop.heartbeat.activity(Activity.EVAL):
        return loop.evaluate(e.num_prompts, e.seed_offset, e.samples_per_prompt, e.temperature)


def _save(loop: RLLoop, saving: CheckpointConfig, config: RunConfig, summary: dict) -> None:
    use_layout(loop.policy.train_layout)
    selector = (
        {"selector": loop.selection.state(), "last_lengths": loop.last_lengths}
        if loop.selection is not None
        else {}
    )
    with loop.heartbeat.activity(Activity.CHECKPOINT):
        ckpt.save_checkpoint(
            saving,
            loop.step,
            loop.policy.ddp_chunks,
            loop.policy.optimizer,
            weight_version=loop.policy.version,
            data_state={"step": loop.step, "summary": summary, **selector},
            model_config=config.model,
            family=family_for_model(config.model).name,
        )
