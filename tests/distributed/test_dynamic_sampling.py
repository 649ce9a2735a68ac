"""Dynamic sampling in the synchronous loop (``rollout.dynamic_sampling``) on 2 gloo ranks, dp2 in
every phase, a tiny model and an environment whose rewards the test controls by task seed
(``SeedClassEnv``: some prompts all-correct, some all-wrong, the rest rewarded by the parity of
the first sampled token, so informative with probability 7/8 at 4 samples).

Loop A (dynamic sampling on, 4 prompts per step, at most 4 extra prompts a step) takes two steps
with ``RLLoop.run_step``:

1. step 0: its own prompts hold at most 2 informative groups (seeds 0 and 1 are all-correct and
   all-wrong), so an extra round draws from step 0's block of seeds; the metrics account for every
   group (drawn = kept + dropped, dropped by verdict + surplus);
2. step 1: step 1's block of extra seeds is all-wrong, so it cannot fill: it trains on the
   informative groups it has, says so in a warning and in ``dynamic_sampling/groups_missing``,
   and the weight version moves on.

Loop B (dynamic sampling off, the same seed: the same initial weights) is given loop A's kept
trajectories of step 0 directly as its rollout: its update equals loop A's exactly (every
parameter shard bitwise, and the loss).

Run: python -m pytest -q tests/distributed/test_dynamic_sampling.py
"""

from __future__ import annotations

import warnings

import torch

from megatron_earl.envs.base import Environment, ResetResult, StepResult
from megatron_earl.testing.distributed import run_distributed

EXTRA_SEEDS = 100
"""``rollout.dynamic_sampling.seed_offset``: step s's extra seeds are 100 + 4s .. 100 + 4s + 3."""


class SeedClassEnv(Environment):
    """One turn. Reward by task seed: below ``EXTRA_SEEDS``, seed % 4 == 0 gives 1 and == 1
    gives 0 whatever the answer; step 0's extra seeds (100..103) and the other training seeds
    give the parity of the answer's first token; step 1's extra seeds (104..) give 0."""

    async def reset(self, seed: int) -> ResetResult:
        self.seed = seed
        return ResetResult([{"role": "user", "content": f"task {seed % 10}"}])

    async def step(self, action) -> StepResult:
        seed = self.seed
        if seed >= EXTRA_SEEDS + 4 or (seed < EXTRA_SEEDS and seed % 4 == 1):
            reward = 0.0
        elif seed < EXTRA_SEEDS and seed % 4 == 0:
            reward = 1.0
        else:
            reward = float(action.token_ids[0] % 2) if action.token_ids else 0.0
        return StepResult(None, reward=reward, done=True)


def _config(dynamic: bool):
    from megatron_earl.config import load_config

    return load_config(
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
            "steps=2",
            "batch.prompts_per_step=4",
            "batch.samples_per_prompt=4",
            "rollout.max_context=64",
            "rollout.max_turns=1",
            "rollout.sampling.max_new_tokens=2",
            # every id stops a turn: the environment gets a one-token answer every time
            f"rollout.sampling.stop_token_ids=[{','.join(map(str, range(320)))}]",
            f"env.name={__name__}:SeedClassEnv",
            f"rollout.dynamic_sampling.enabled={str(dynamic).lower()}",
            f"rollout.dynamic_sampling.seed_offset={EXTRA_SEEDS}",
            "rollout.dynamic_sampling.max_extra_prompts=4",
            "rollout.dynamic_sampling.max_extra_rounds=2",
        ]
    )


def _weights(loop) -> dict:
    from megatron_earl.redistribute.geometry import shard_pieces

    return {
        (p.key, p.region): p.local.detach().clone() for p in shard_pieces(loop.policy.ddp_chunks)
    }


def _run():
    from megatron_earl.orchestration.dynamic_sampling import UnfilledStepWarning
    from megatron_earl.orchestration.engines import Rollout
    from megatron_earl.orchestration.loop import RLLoop
    from megatron_earl.tokenizer import build_tokenizer

    config = _config(True)
    tokenizer = build_tokenizer(config.tokenizer)
    a = RLLoop(config, tokenizer)
    fills = []
    fill = a.sampler.fill

    def recorded(step, first, generate, min_samples):
        out = fill(step, first, generate, min_samples)
        fills.append((first.source, out[1]))
        return out

    a.sampler.fill = recorded
    metrics = [a.run_step()]
    after_a = _weights(a)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics.append(a.run_step())
    unfilled = [str(w.message) for w in caught if issubclass(w.category, UnfilledStepWarning)]
    del a

    b = RLLoop(_config(False), tokenizer)
    source, kept = fills[0]
    b.rollout = lambda prompts, agent, layout=None: Rollout(kept, source)
    given = b.run_step()
    return {
        "metrics": metrics,
        "unfilled": unfilled,
        "kept_groups": sorted({t.group_id for t in kept}),
        "equal": all(torch.equal(w, after_a[k]) for k, w in _weights(b).items()),
        "given": given,
    }


def test_dynamic_sampling_fills_steps_and_equals_the_update_on_the_kept_groups():
    results = run_distributed(_run, 2, timeout_s=300)
    for res in results:
        step0, step1 = res["metrics"]
        for m in (step0, step1):
            g = {k.split("/groups_")[1]: v for k, v in m.items() if "/groups_" in k}
            assert g["drawn"] == g["kept"] + g["dropped"], g
            dropped = g["dropped_all_correct"] + g["dropped_all_wrong"] + g["dropped_other"]
            assert g["dropped"] == dropped + g["surplus"], g
            assert g["missing"] == 4 - (g["kept"] - g["filler"]), g
        # step 0: seeds 0 (all correct) and 1 (all wrong) dropped, one extra round of 4 prompts
        assert step0["dynamic_sampling/extra_rounds"] == 1.0
        assert step0["dynamic_sampling/groups_drawn"] == 8.0
        assert step0["dynamic_sampling/groups_dropped_all_correct"] >= 1
        assert step0["dynamic_sampling/extra_trajectories"] == 16.0
        # with these seeds the extra round fills the step (each parity group is informative
        # with probability 7/8)
        assert step0["dynamic_sampling/groups_missing"] == 0 and step0["train/grad_norm"] > 0
        assert step0["rollout/trajectories"] == 32.0  # every drawn trajectory
        # step 1: the extra round is all wrong: it trains on what it has, and says so
        assert step1["dynamic_sampling/groups_missing"] >= 2 and len(res["unfilled"]) == 1
        assert res["unfilled"][0].startswith("step 1: dynamic sampling kept ")
        assert step1["weight_version"] == 2.0 and "train/loss" in step1
        # the same update as training on the kept groups given directly
        assert len(res["kept_groups"]) <= 4
        assert any(int(g.split("-")[1]) >= 4 for r in results for g in r["kept_groups"])
        assert res["equal"]
        assert res["given"]["train/loss"] == step0["train/loss"]
        assert res["given"]["train/grad_norm"] == step0["train/grad_norm"]
        assert res["given"]["train/num_samples"] == step0["train/num_samples"]
