"""The peer benchmark's workloads: one settings value builds both our run and TRL's.

    config = workload_config("configs/demo_cpu.yaml", WORKLOADS["multi-turn-tool"], ["seed=7"])
    settings = PeerSettings.from_run(config, WORKLOADS["multi-turn-tool"])
    ours_overrides(WORKLOADS["multi-turn-tool"], init="w/mcore", steps=4, out="w/runs", name="o1")
    trl_arguments(settings, output_dir="w/trl", steps=4)       # GRPOConfig keyword arguments

Two workloads on the demo model (``configs/demo_cpu.yaml`` by default), the arithmetic env and
the demo's batch, sampling and loss settings:

- ``single-turn``: the initial random weights, one model turn per sample (``rollout.max_turns=1``;
  on TRL the stock generation path, no ``rollout_func``);
- ``multi-turn-tool``: warm-started (our SFT), calculator tool, up to ``rollout.max_turns`` (3)
  model turns; on TRL a ``rollout_func`` drives TRL's own generation turn by turn
  (``bench.peer_trl``).

Both sides start from the same weights (``bench.peer_weights``). Counting rule, the same
on both sides: completion tokens are the model-generated tokens (the trainable tokens: loss mask
1); tool-output tokens appended between turns are not counted. Pure: no process group, no TRL
import (the keyword arguments are checked against ``GRPOConfig`` where TRL runs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_earl.config.loader import load_config
from megatron_earl.config.run import RunConfig


@dataclass(frozen=True)
class Workload:
    """One of the benchmark's workloads."""

    name: str
    """Name on the command line (``--workloads``)."""
    max_turns: int
    """Model turns per sample (``rollout.max_turns``)."""
    warm_start: bool
    """Start from our SFT warm start (``sft`` section of the config) instead of the random
    initial weights."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(
                f"workload {self.name!r}: max_turns must be >= 1, got {self.max_turns}"
            )


WORKLOADS = {
    w.name: w
    for w in (
        Workload("single-turn", max_turns=1, warm_start=False),
        Workload("multi-turn-tool", max_turns=3, warm_start=True),
    )
}
"""The benchmark's workloads by name."""


def workload_config(path: str, workload: Workload, overrides: list[str] = ()) -> RunConfig:
    """The run config of ``workload``: ``path`` + the user's ``overrides`` + the workload's own
    settings (which win: they define the workload)."""
    forced = [f"rollout.max_turns={workload.max_turns}"]
    if not workload.warm_start:
        forced.append("sft.steps=0")
    return load_config(path, [*overrides, *forced])


_TRL_AGGREGATION = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}
"""Our loss aggregation -> TRL's ``loss_type`` computing the same: ``dapo`` normalises the summed
token losses by the trainable tokens of the whole (global) batch, ``grpo`` averages per sequence
then over sequences."""


@dataclass(frozen=True)
class PeerSettings:
    """Everything both sides must agree on, read from one run config."""

    workload: str
    """Workload name."""
    seed: int
    """Run seed (TRL's ``seed``)."""
    env: dict[str, Any]
    """Environment spec (``ENVS.build``)."""
    prompts_per_step: int
    """Prompts per RL step."""
    samples_per_prompt: int
    """Samples per prompt (the GRPO group; TRL's ``num_generations``)."""
    max_turns: int
    """Model turns per sample."""
    max_new_tokens: int
    """New tokens per model turn (TRL's ``max_completion_length``, applied per generate call)."""
    max_context: int
    """Context limit of a sample (prompt + every turn + tool outputs)."""
    temperature: float
    """Sampling temperature."""
    top_p: float
    """Nucleus sampling."""
    lr: float
    """Constant learning rate."""
    weight_decay: float
    """AdamW weight decay."""
    adam_betas: tuple[float, float]
    """Adam betas."""
    adam_eps: float
    """Adam epsilon."""
    clip_grad: float
    """Global gradient-norm clip."""
    clip_eps: tuple[float, float]
    """PPO-clip ratio bounds (low, high)."""
    trl_loss_type: str
    """TRL's ``loss_type`` equal to our aggregation (``_TRL_AGGREGATION``)."""
    kl_coef: float
    """KL coefficient (TRL's ``beta``)."""
    sft_steps: int
    """Warm-start SFT steps taken before both sides start (0: random initial weights)."""

    @classmethod
    def from_run(cls, config: RunConfig, workload: Workload) -> PeerSettings:
        """The settings of ``config`` (built by ``workload_config``); raises ``ValueError`` naming
        every setting TRL's GRPOTrainer cannot reproduce."""
        t, r = config.train, config.rollout
        problems = []
        if t.loss.loss_type != "ppo":
            problems.append(f"train.loss.loss_type={t.loss.loss_type!r} (TRL peer: 'ppo')")
        if t.loss.aggregation not in _TRL_AGGREGATION:
            problems.append(
                f"train.loss.aggregation={t.loss.aggregation!r} (TRL peer: one of "
                f"{sorted(_TRL_AGGREGATION)})"
            )
        if t.advantage != "grpo" or t.advantage_kwargs:
            problems.append(
                f"train.advantage={t.advantage!r} with kwargs {t.advantage_kwargs} "
                "(TRL peer: 'grpo', no kwargs)"
            )
        if config.batch.num_mini_batches != 1:
            problems.append(f"batch.num_mini_batches={config.batch.num_mini_batches} (TRL peer: 1)")
        if r.sampling.top_k != -1:
            problems.append(f"rollout.sampling.top_k={r.sampling.top_k} (TRL peer: -1, off)")
        off_policy = t.loss.off_policy_correction != "none"  # tis_cap maps onto it
        if t.loss.entropy_coef or off_policy or t.loss.dual_clip_c is not None:
            problems.append(
                "train.loss entropy_coef / off_policy_correction (tis_cap) / dual_clip_c "
                "(TRL peer: off)"
            )
        if problems:
            raise ValueError(
                f"workload {workload.name!r}: settings the TRL side cannot match: "
                + "; ".join(problems)
            )
        return cls(
            workload=workload.name,
            seed=config.seed,
            env=config.env.spec(),
            prompts_per_step=config.batch.prompts_per_step,
            samples_per_prompt=config.batch.samples_per_prompt,
            max_turns=r.max_turns,
            max_new_tokens=r.sampling.max_new_tokens,
            max_context=r.max_context,
            temperature=r.sampling.temperature,
            top_p=r.sampling.top_p,
            lr=t.lr,
            weight_decay=t.weight_decay,
            adam_betas=(t.adam_beta1, t.adam_beta2),
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            clip_eps=(t.loss.clip_eps_low, t.loss.clip_eps_high),
            trl_loss_type=_TRL_AGGREGATION[t.loss.aggregation],
            kl_coef=t.loss.kl_coef,
            sft_steps=config.sft.steps if workload.warm_start else 0,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, tree: dict[str, Any]) -> PeerSettings:
        return cls(
            **{
                **tree,
                "adam_betas": tuple(tree["adam_betas"]),
                "clip_eps": tuple(tree["clip_eps"]),
            }
        )


def ours_overrides(workload: Workload, *, init: str, steps: int, out: str, name: str) -> list[str]:
    """Overrides of our measured run: start from ``init`` (the Megatron copy of the shared
    weights; the warm start is already in it), ``steps`` RL steps, no evaluation, metrics to
    ``<out>/<name>/metrics.jsonl``, no TensorBoard or progress bar."""
    return [
        f"rollout.max_turns={workload.max_turns}",
        "sft.steps=0",
        f"checkpoint.load={init}",
        "checkpoint.resume=false",
        f"steps={steps}",
        "eval.num_prompts=0",
        "eval.interval=0",
        f"output_dir={out}",
        f"name={name}",
        "logging.tensorboard=false",
        "logging.progress=false",
    ]


def trl_arguments(
    settings: PeerSettings, *, output_dir: str, steps: int, num_processes: int = 1
) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments of ``settings``: one optimizer step per generation batch
    of ``prompts_per_step x samples_per_prompt`` completions (split over ``num_processes``), on
    the CPU in fp32, no logging or saving, prompts in dataset order (step k sees the seeds our
    step k sees)."""
    samples = settings.prompts_per_step * settings.samples_per_prompt
    if samples % num_processes:
        raise ValueError(
            f"{samples} samples per step do not split over {num_processes} TRL processes"
        )
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        seed=settings.seed,
        per_device_train_batch_size=samples // num_processes,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=settings.samples_per_prompt,
        max_completion_length=settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=0,
        learning_rate=settings.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_betas[0],
        adam_beta2=settings.adam_betas[1],
        adam_epsilon=settings.adam_eps,
        max_grad_norm=settings.clip_grad,
        epsilon=settings.clip_eps[0],
        epsilon_high=settings.clip_eps[1],
        loss_type=settings.trl_loss_type,
        beta=settings.kl_coef,
        scale_rewards="group",
        shuffle_dataset=False,
        # TRL defaults to activation checkpointing (recompute in backward); ours keeps the
        # activations of this tiny model, so TRL runs without recompute too.
        activation_checkpointing=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
