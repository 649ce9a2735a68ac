"""A step without usable trajectories is skipped, not a crash in the dispatcher (issue 22 item 4).

Two gloo ranks, dp=2 in every phase, an environment whose ``reset`` raises for every task seed
but 3: step 0 (seeds 0, 1) has no usable trajectory and is skipped with a warning naming the
cause; step 1 (seeds 2, 3) has one usable group, on one rank only, and trains; step 2 is skipped
again (1 of at most ``rollout.max_empty_steps=1``); step 3 stops the run with
``EmptyStepsError`` naming the cause. Before the fix step 0 died in the dispatcher with
"0 samples cannot fill dp=2 ranks".

Run: python -m pytest -q tests/distributed/test_empty_steps.py
"""

from __future__ import annotations

import warnings

from megatron_earl.envs.arithmetic import ArithmeticEnv
from megatron_earl.testing.distributed import run_distributed


class BrokenDatasetEnv(ArithmeticEnv):
    """Its ``reset`` raises for every task seed but 3."""

    async def reset(self, seed: int):
        if seed != 3:
            raise RuntimeError(f"dataset row {seed} is missing")
        return await super().reset(seed)


def _run():
    from megatron_earl.config import load_config
    from megatron_earl.orchestration.loop import EmptyStepsError, EmptyStepWarning, RLLoop
    from megatron_earl.tokenizer import build_tokenizer

    config = load_config(
        overrides=[
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.ffn_hidden_size=64",
            "model.num_attention_heads=2",
            "model.vocab_size=320",
            "model.make_vocab_size_divisible_by=64",
            "layouts.rollout=tp1cp1pp1dp2",
            "layouts.experience=tp1cp1pp1dp2",
            "layouts.train=tp1cp1pp1dp2",
            "steps=4",
            "batch.prompts_per_step=2",
            "batch.samples_per_prompt=2",
            "rollout.max_context=64",
            "rollout.max_turns=1",
            "rollout.sampling.max_new_tokens=8",
            "rollout.max_empty_steps=1",
            f"env.name={__name__}:BrokenDatasetEnv",
        ]
    )
    loop = RLLoop(config, build_tokenizer(config.tokenizer))
    steps, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(4):
                metrics = loop.run_step()
                steps.append(
                    (
                        metrics["rollout/empty_steps"],
                        metrics["weight_version"],
                        "train/loss" in metrics,
                    )
                )
        except EmptyStepsError as err:
            error = str(err)
    messages = [str(w.message) for w in caught if issubclass(w.category, EmptyStepWarning)]
    return steps, messages, error, loop.step


def test_empty_steps_are_skipped_then_stop_the_run_with_the_cause():
    for steps, messages, error, step in run_distributed(_run, 2, timeout_s=300):
        assert steps == [(1.0, 0.0, False), (0.0, 1.0, True), (1.0, 1.0, False)]
        assert len(messages) == 2
        assert messages[0].startswith("step 0: 0 usable trajectories of 4")
        assert "env_error x4" in messages[0] and "need >= 2: one per data-parallel" in messages[0]
        assert "dataset row 0 is missing" in messages[0] or "dataset row 1" in messages[0]
        assert "step skipped (weights unchanged), 1 of at most 1" in messages[0]
        assert messages[1].startswith("step 2: 0 usable trajectories of 4")
        assert error is not None and error.startswith("step 3: 0 usable trajectories of 4")
        assert "env_error x4" in error and "is missing" in error
        assert "exceed rollout.max_empty_steps=1" in error
        assert step == 3
