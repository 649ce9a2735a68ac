"""The peer benchmark's TRL side: a workload on Hugging Face TRL's ``GRPOTrainer``, one run.

    python -m megatron_earl.bench.peer_trl --settings s.json --hf work/st/hf \\
        --steps 4 --out trl.json                 # (bench_peer starts it; needs the [bench] extra)
    torchrun --standalone --nproc_per_node 2 -m megatron_earl.bench.peer_trl ...
                                                 # data-parallel over 2 processes (gloo)

The model is the HF copy of the shared start weights (``LlamaForCausalLM``), the tokenizer the
demo tokenizer's HF twin (``tokenizer.demo_hf``), prompts the environment's, rendered with the
demo chat template into text (TRL tokenizes text prompts as they are: same ids). Generation
stops on the demo's stop ids (``<|im_end|>``, eos). Rewards: the environment's own code
(``reset`` + ``step`` on each model turn, as our agent loop calls them); a turn that hits the
token limit without a stop id ends the sample with reward 0, as ours.

- single turn (``max_turns == 1``): TRL's stock path -- ``GRPOTrainer`` generates (HF
  ``generate``), a reward function runs the environment on the completion;
- multi-turn tool: TRL's built-in ``tools=`` loop needs a Jinja chat template with tool schemas
  and a response parser (the demo tokenizer has neither, and the schema would change the prompt),
  so a ``rollout_func`` drives TRL's own generation (``GRPOTrainer._generate_single_turn``, what
  its tool loop calls for every turn) turn by turn: generate for the samples still running, run
  the environment's ``step`` on each stopped turn, append the tool response
  (``end_of_turn_suffix + render_turn + generation_prompt``, as ours) with ``env_mask`` 0, until
  the answer, ``max_turns`` or ``max_context``. The reward is the environment's, passed on to the
  reward function.

Timing: wall time per optimizer step (``on_step_begin`` -> ``on_step_end``) and, inside it, the
time of ``_generate_and_score_completions`` (generation, rewards, advantages; TRL skips the
old-log-prob forward here: one generation per optimizer step is on-policy); the rest is the
loss forward/backward and the optimizer step. Completion tokens = model-generated tokens
(``completion_mask * env_mask``, summed over the processes). The update's forward runs over the
padded batch: ``forward_positions`` = samples x (longest prompt + longest completion), next to
its ``real_tokens`` (prompt + completion tokens, tool responses included). Rank 0 writes one JSON
document: per-step records (its clock) and the settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from megatron_earl.bench.peer_workload import PeerSettings, trl_arguments
from megatron_earl.envs.base import ENVS, Action
from megatron_earl.tokenizer.demo import DemoTokenizer

TRL_GENERATE, TRL_UPDATE = "generate", "update"
"""TRL's two timed parts of a step (``time/<part>`` in the records): ``generate`` is
``_generate_and_score_completions`` (generation, rewards, advantages), ``update`` the rest (loss
forward/backward, clip, optimizer step)."""


def prompt_texts(settings: PeerSettings, seeds: list[int], demo: DemoTokenizer) -> list[str]:
    """The environment's prompt of each seed as text that re-encodes to the exact ids our agent
    loop renders; raises ``ValueError`` naming a seed whose text would not."""

    async def reset(seed: int):
        return (await ENVS.build(settings.env).reset(seed)).prompt

    texts = []
    for seed in seeds:
        ids = demo.render_messages(asyncio.run(reset(seed)), add_generation_prompt=True)
        text = demo.decode(ids)
        if demo.encode(text) != ids:
            raise ValueError(f"prompt of seed {seed} does not round-trip through text: {text!r}")
        texts.append(text)
    return texts


async def _steps(envs: list, seeds: list[int], actions: list[Action | None], reset: bool):
    """``step`` of each environment that has an action (after ``reset`` when asked)."""

    async def one(env, seed, action):
        if reset:
            await env.reset(seed)
        return None if action is None else await env.step(action)

    return await asyncio.gather(*(one(e, s, a) for e, s, a in zip(envs, seeds, actions)))


def _action(ids: list[int], demo: DemoTokenizer) -> Action | None:
    """The environment's view of a model turn; None when the turn hit the token limit."""
    stopped = bool(ids) and ids[-1] in demo.stop_ids
    return Action(demo.decode(ids[:-1]), tuple(ids)) if stopped else None


def single_turn_reward(settings: PeerSettings, demo: DemoTokenizer):
    """TRL reward function: the environment's reward of the one model turn."""

    def env_reward(completion_ids: list[list[int]], seed: list[int], **_) -> list[float]:
        actions = [_action(list(ids), demo) for ids in completion_ids]
        envs = [ENVS.build(settings.env) for _ in actions]
        results = asyncio.run(_steps(envs, list(seed), actions, reset=True))
        return [0.0 if r is None else float(r.reward) for r in results]

    return env_reward


def multi_turn_rollout(settings: PeerSettings, demo: DemoTokenizer, seed_of: dict[str, int]):
    """TRL ``rollout_func``: the multi-turn tool loop on TRL's own generation."""
    tool_tail = demo.generation_prompt()

    def rollout(prompts: list[str], trainer) -> dict[str, Any]:
        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        seeds = [seed_of[p] for p in prompts]
        envs = [ENVS.build(settings.env) for _ in prompts]
        asyncio.run(_steps(envs, seeds, [None] * len(envs), reset=True))
        completion: list[list[int]] = [[] for _ in prompts]
        mask: list[list[int]] = [[] for _ in prompts]
        reward = [0.0] * len(prompts)
        active = list(range(len(prompts)))
        for turn in range(settings.max_turns):
            if not active:
                break
            contexts = [prompt_ids[i] + completion[i] for i in active]
            outputs, _ = trainer._generate_single_turn(contexts, None, {}, 1)
            actions = []
            for i, ids in zip(active, outputs, strict=True):
                completion[i] += ids
                mask[i] += [1] * len(ids)
                actions.append(_action(ids, demo))
            picked = [envs[i] for i in active]
            results = asyncio.run(_steps(picked, [seeds[i] for i in active], actions, reset=False))
            still = []
            for i, result in zip(active, results, strict=True):
                if result is None:
                    continue
                reward[i] += float(result.reward)
                if result.done or turn == settings.max_turns - 1:
                    continue
                obs = (
                    demo.end_of_turn_suffix()
                    + demo.render_turn(result.role, result.observation)
                    + tool_tail
                )
                if len(prompt_ids[i]) + len(completion[i]) + len(obs) >= settings.max_context:
                    continue
                completion[i] += obs
                mask[i] += [0] * len(obs)
                still.append(i)
            active = still
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion,
            "logprobs": None,
            "env_mask": mask,
            "env_reward": reward,
        }

    return rollout


def passed_reward(env_reward: list[float], **_) -> list[float]:
    """TRL reward function of the multi-turn workload: the environment's reward of the episode,
    computed in the rollout."""
    return list(env_reward)


def run(
    settings: PeerSettings, hf_dir: str, steps: int, work_dir: str, num_processes: int = 1
) -> dict[str, Any]:
    """Train ``steps`` GRPO steps on TRL (in each of ``num_processes`` processes: under torchrun
    when > 1, gloo); the per-step records (this process's clock, token counts of all) and the
    run's settings."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_earl.tokenizer.demo_hf import demo_hf_tokenizer

    demo = DemoTokenizer()
    seeds = list(range(steps * settings.prompts_per_step))
    texts = prompt_texts(settings, seeds, demo)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = list(demo.stop_ids)
    model.generation_config.bos_token_id = None
    records: list[dict[str, float]] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            mask = out["completion_mask"]
            if "tool_mask" in out:
                mask = mask * out["tool_mask"]
            prompt, completion = out["prompt_mask"], out["completion_mask"]
            # the update's forward runs over the padded [prompt | completion] batch
            width = prompt.size(1) + completion.size(1)
            real = prompt.sum() + completion.sum()
            # every process calls: the step's counts over all of them
            counts = self.accelerator.gather(
                torch.tensor([[mask.sum(), mask.size(0), mask.size(0) * width, real]])
            )
            records.append(
                {
                    f"time/{TRL_GENERATE}": time.perf_counter() - start,
                    "completion_tokens": float(counts[:, 0].sum()),
                    "samples": float(counts[:, 1].sum()),
                    "forward_positions": float(counts[:, 2].sum()),
                    "real_tokens": float(counts[:, 3].sum()),
                }
            )
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            records[-1]["time/step"] = time.perf_counter() - self.start

    multi = settings.max_turns > 1
    trainer = Timed(
        model=model,
        reward_funcs=passed_reward if multi else single_turn_reward(settings, demo),
        args=GRPOConfig(
            **trl_arguments(settings, output_dir=work_dir, steps=steps, num_processes=num_processes)
        ),
        train_dataset=Dataset.from_dict({"prompt": texts, "seed": seeds}),
        processing_class=demo_hf_tokenizer(),
        callbacks=[StepClock()],
        rollout_func=multi_turn_rollout(settings, demo, dict(zip(texts, seeds))) if multi else None,
    )
    trainer.train()
    for r in records:
        r[f"time/{TRL_UPDATE}"] = r["time/step"] - r[f"time/{TRL_GENERATE}"]
    return {
        "steps": records,
        "processes": num_processes,
        "torch_threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "generation": "rollout_func on _generate_single_turn" if multi else "stock",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", required=True, help="PeerSettings JSON file")
    parser.add_argument("--hf", required=True, help="HF copy of the shared start weights")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    settings = PeerSettings.from_dict(json.loads(Path(args.settings).read_text()))
    out = Path(args.out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    result = run(settings, args.hf, args.steps, str(out.parent / f"{out.stem}-trainer"), world)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    from megatron_earl.compat.processes import skip_exit_gc

    skip_exit_gc()
    sys.exit(main())
