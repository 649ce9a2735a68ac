"""The Hugging Face side of ``bench engine``: the same weights as a ``transformers`` model, timed
with ``generate``, and the checks that the two models compute the same function.

Used by ``megatron_earl/bench/engine.py`` (run ``megatron-earl bench engine``); nothing here runs
alone. The Megatron state is converted with the project's converter (``models.hf_mapping``, built
on ``convert.mapping``) and the HF config with ``convert.families``, so a mapping bug shows up as
a logits mismatch here. Pure single-process code: no torch.distributed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from megatron_earl.config.model import ModelConfig

LOGITS_TOL = 1e-4
"""Max |logit difference| allowed between the Megatron and HF forwards of one prompt (fp32; the
two models order their float operations differently, observed ~1e-6)."""


def hf_model(full: Mapping[str, torch.Tensor], model: ModelConfig) -> Any:
    """A ``transformers`` causal LM (fp32, CPU, eval, SDPA attention) holding the weights of the
    full Megatron state ``full`` (``geometry.full_state_dict`` keys); end of sequence disabled so
    that ``generate`` always produces ``max_new_tokens``."""
    import transformers

    from megatron_earl.convert.families import family_for_model, hf_config_from_model
    from megatron_earl.models.hf_mapping import full_megatron_to_hf

    family = family_for_model(model)
    cfg = hf_config_from_model(model, family, {"eos_token_id": None, "bos_token_id": None})
    cfg["dtype"] = "float32"
    config = transformers.AutoConfig.for_model(
        cfg.pop("model_type"), attn_implementation="sdpa", **cfg
    )
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(full_megatron_to_hf(full, model), strict=False)
    # Rotary inverse frequencies are buffers computed from the config, not weights.
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"HF model state mismatch: missing {missing}, unexpected {unexpected}")
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0  # never used: every prompt has the same length
    return hf.eval()


@torch.no_grad()
def logits_max_diff(
    megatron_lm: torch.nn.Module, hf: Any, prompt: torch.Tensor, vocab: int
) -> tuple[float, float]:
    """(max |logit difference|, max |logit|) of the two models on one prompt ``[T]``, over the
    unpadded vocabulary. ``megatron_lm`` is a TP1 Megatron GPT model."""
    tokens = prompt[None]
    ours = megatron_lm.eval()(tokens, torch.arange(tokens.size(1))[None], None)[..., :vocab]
    theirs = hf(input_ids=tokens).logits
    return float((ours.float() - theirs.float()).abs().max()), float(ours.abs().max())


@torch.no_grad()
def hf_generate(
    hf: Any, prompts: torch.Tensor, new_tokens: int, *, sampled: bool
) -> tuple[float, torch.Tensor]:
    """``generate`` exactly ``new_tokens`` tokens after each row of ``prompts`` ``[B, T]``.

    Greedy, or plain temperature-1 sampling (no top-k / top-p) when ``sampled``. Returns (wall
    seconds, new tokens ``[B, new_tokens]``)."""
    knobs: dict[str, Any] = (
        {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        if sampled
        else {"do_sample": False}
    )
    start = time.perf_counter()
    out = hf.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        **knobs,
    )
    seconds = time.perf_counter() - start
    new = out[:, prompts.size(1) :]
    if new.shape != (prompts.size(0), new_tokens):
        raise RuntimeError(f"HF generate returned {tuple(new.shape)} new tokens, not {new_tokens}")
    return seconds, new


@torch.no_grad()
def hf_next_logprobs(hf: Any, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(``tokens[b]`` | ``prompts[b]``) under the HF model, ``[B]``."""
    logits = hf(input_ids=prompts).logits[:, -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]


def greedy_agreement(ours: list[tuple[int, ...]], theirs: torch.Tensor, first: int) -> int:
    """How many of the first ``first`` greedy tokens of each request agree, counted per request
    up to its first difference (after one flip the two continuations see different contexts)."""
    agree = 0
    for mine, hf_row in zip(ours, theirs.tolist(), strict=True):
        for a, b in zip(mine[:first], hf_row[:first], strict=True):
            if a != b:
                break
            agree += 1
    return agree
