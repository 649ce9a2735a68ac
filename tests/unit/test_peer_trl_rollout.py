"""The TRL side's multi-turn tool loop (``peer_trl.multi_turn_rollout``) builds what our agent
loop builds: driven by a stand-in for TRL's generation that replays the environment's ideal
conversation, every sample's completion is the chat template's rendering of that conversation
after the prompt (tool responses included, masked out with ``env_mask`` 0) and earns the
environment's reward; a direct answer (no tool) and a turn without a stop id end the sample with
the environment's verdict, as ours. The single-turn reward function scores the same way.

Run: python -m pytest -q -p no:warnings tests/unit/test_peer_trl_rollout.py
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from megatron_earl.bench.peer_trl import (
    multi_turn_rollout,
    prompt_texts,
    single_turn_reward,
)
from megatron_earl.bench.peer_workload import WORKLOADS, PeerSettings, workload_config
from megatron_earl.envs import ENVS
from megatron_earl.tokenizer.demo import DemoTokenizer
from megatron_earl.tokenizer.demo_hf import demo_hf_tokenizer

DEMO = DemoTokenizer()
SEEDS = [3, 4, 5]


def _settings(name: str) -> PeerSettings:
    workload = WORKLOADS[name]
    return PeerSettings.from_run(workload_config("configs/demo_cpu.yaml", workload), workload)


class ReplayTrainer:
    """Stands in for ``GRPOTrainer``: each context continues with the next assistant turn of the
    scripted conversation it is a prefix of (up to and including ``<|im_end|>``)."""

    processing_class = demo_hf_tokenizer()

    def __init__(self, scripts: list[list[int]]) -> None:
        self.scripts = scripts
        self.calls: list[int] = []

    def _generate_single_turn(self, contexts, images, multimodal_fields, num_generations):
        assert images is None and multimodal_fields == {} and num_generations == 1
        self.calls.append(len(contexts))
        out = []
        for ctx in contexts:
            script = next(s for s in self.scripts if s[: len(ctx)] == ctx and len(s) > len(ctx))
            rest = script[len(ctx) :]
            end = rest.index(DEMO.im_end_id) + 1 if DEMO.im_end_id in rest else len(rest)
            out.append(rest[:end])
        return out, None


def test_ideal_conversations_are_rendered_like_ours():
    settings = _settings("multi-turn-tool")
    env = ENVS.build(settings.env)
    texts = prompt_texts(settings, SEEDS, DEMO)
    scripts = [
        DEMO.render_messages(env.demonstration(s), add_generation_prompt=False) for s in SEEDS
    ]
    trainer = ReplayTrainer(scripts)
    out = multi_turn_rollout(settings, DEMO, dict(zip(texts, SEEDS)))(texts, trainer)
    assert trainer.calls == [3, 3]  # two model turns: the call, then the answer
    assert out["env_reward"] == [1.0, 1.0, 1.0]
    assert out["logprobs"] is None
    for seed, prompt, completion, mask, script in zip(
        SEEDS, out["prompt_ids"], out["completion_ids"], out["env_mask"], scripts, strict=True
    ):
        assert prompt + completion == script[: -len(DEMO.end_of_turn_suffix())], seed
        call, answer = (m["content"] for m in env.demonstration(seed) if m["role"] == "assistant")
        assert len(mask) == len(completion)
        # exactly the two sampled turns are trainable: the tool call and the answer, each
        # ending with <|im_end|>; the tool response in between (with its template) is not
        model_ids = [t for t, m in zip(completion, mask, strict=True) if m]
        end = [DEMO.im_end_id]
        assert model_ids == DEMO.encode(call) + end + DEMO.encode(answer) + end, seed
        assert 0 in mask


def test_direct_answers_and_unstopped_turns_end_the_sample():
    settings = _settings("multi-turn-tool")
    env = ENVS.build(settings.env)
    texts = prompt_texts(settings, SEEDS[:2], DEMO)
    prompts = [DEMO.render_messages(env.make_task(s)[0], True) for s in SEEDS[:2]]
    direct = prompts[0] + DEMO.encode(env.make_task(SEEDS[0])[1]["target"]) + [DEMO.im_end_id]
    rambling = prompts[1] + DEMO.encode("1" * settings.max_new_tokens)
    trainer = ReplayTrainer([direct, rambling])
    out = multi_turn_rollout(settings, DEMO, dict(zip(texts, SEEDS)))(texts, trainer)
    assert trainer.calls == [2]
    assert out["env_reward"] == [0.0, 0.0]  # the right answer without the tool earns nothing
    assert out["env_mask"] == [[1] * len(c) for c in out["completion_ids"]]


def test_single_turn_reward_is_the_environments():
    settings = _settings("single-turn")
    env = ENVS.build(settings.env)
    targets = [env.make_task(s)[1]["target"] for s in SEEDS]
    completions = [
        [*DEMO.encode(targets[0]), DEMO.im_end_id],  # right, but no tool call: 0
        [*DEMO.encode(f"<tool_call>{targets[1]}"), DEMO.im_end_id],  # a (malformed) call: 0
        DEMO.encode(targets[2]),  # no stop id: cut at the token limit, 0
    ]
    reward = single_turn_reward(settings, DEMO)
    assert reward(completion_ids=completions, seed=SEEDS) == [0.0, 0.0, 0.0]
    kwargs = {**settings.env["kwargs"], "require_tool": False}
    lenient = dataclasses.replace(settings, env={**settings.env, "kwargs": kwargs})
    assert single_turn_reward(lenient, DEMO)(completion_ids=completions, seed=SEEDS) == [1, 0, 0]
