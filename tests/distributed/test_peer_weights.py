"""``bench peer``'s shared start weights: the demo policy after a few SFT steps, saved by
``peer_weights.save_start_weights`` and converted to HF (``LlamaForCausalLM``), gives in
``transformers`` (fp32) the logits our Megatron model gives after loading the same checkpoint
the way our measured run does (``checkpoint.load`` -> ``load_initial_weights``); and the demo
tokenizer's HF twin tokenizes the prompt TRL sees into the ids our agent loop renders.

Run: python -m pytest -q -p no:warnings tests/distributed/test_peer_weights.py
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import assert_fp32_close, gpt_terms

DEMO = "configs/demo_cpu.yaml"
ONE_RANK = [f"layouts.{phase}=tp1cp1pp1dp1" for phase in ("rollout", "experience", "train")]


def _conversation_ids() -> torch.Tensor:
    from megatron_earl.envs import ENVS
    from megatron_earl.tokenizer.demo import DemoTokenizer

    demo, env = DemoTokenizer(), ENVS.build("arithmetic")
    rows = [demo.render_messages(env.demonstration(seed), False)[:24] for seed in range(3)]
    return torch.tensor(rows)


def _save_convert_and_forward(root: str, tokens: torch.Tensor):
    """Every rank (a world of one): start weights (2 SFT steps) -> HF; our logits after loading
    the Megatron checkpoint as ``checkpoint.load`` does, and the model's config."""
    from megatron_earl import runtime
    from megatron_earl.bench.peer_weights import save_start_weights
    from megatron_earl.config.loader import load_config
    from megatron_earl.convert.convert import mcore_to_hf
    from megatron_earl.convert.initial import load_initial_weights
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.training.checkpoint import resolve_checkpoint
    from megatron_earl.training.schedule import forward_backward

    config = load_config(DEMO, [*ONE_RANK, "sft.steps=2", "sft.examples_per_step=4"])
    save_start_weights(config, f"{root}/mcore")
    mcore_to_hf(resolve_checkpoint(f"{root}/mcore"), f"{root}/hf")
    use_layout(ParallelLayout())
    runtime.seed(99)  # a different init: the loaded weights must replace it
    chunks = build_model(config.model)
    assert load_initial_weights(chunks, f"{root}/mcore") == "mcore"
    batch = {
        "tokens": tokens,
        "position_ids": torch.arange(tokens.size(1)).expand_as(tokens).contiguous(),
    }

    def keep(logits, _):
        return logits.sum() * 0.0, {"logits": logits.detach().float().clone()}

    return forward_backward(chunks, [batch], keep, forward_only=True)[0]["logits"], config.model


def test_hf_copy_gives_our_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    tokens = _conversation_ids()
    ((ours, model_config),) = run_distributed(
        _save_convert_and_forward, 1, args=(str(tmp_path), tokens), timeout_s=300
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        theirs = model(tokens).logits
    assert theirs.shape == (3, 24, 320)
    # two implementations of one forward: the fp32 bound of its sums in another order (~6e-4 x
    # |logit|); a weight in the wrong slot moves logits by O(1)
    assert_fp32_close(ours[..., :320], theirs, gpt_terms(model_config, tokens.size(1)))
    # not trivially equal: the warm start moved the weights away from a constant output
    assert theirs.std(dim=-1).min() > 1e-3
