"""SFT warm-start data: an environment's ideal conversation rendered exactly as the agent loop
would produce it, with the same loss mask (1 on assistant turns, 0 on everything else).

``demonstration_tokens(env.demonstration(seed), tokenizer)`` -> ``(prompt_ids, response_ids,
loss_mask)``: assistant turns are ``encode(content) + [end_of_turn_id]``; observation turns are
``end_of_turn_suffix + render_turn(role, content) + generation_prompt``. A policy that samples
exactly these assistant ids reproduces the sequence token for token (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_earl.tokenizer.base import ChatTokenizer, Message


def demonstration_tokens(
    messages: Sequence[Message], tokenizer: ChatTokenizer
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, loss mask) of a demonstration (see the module docstring)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or messages[-1]["role"] != "assistant":
        raise ValueError("a demonstration needs assistant turns and must end with one")
    prompt = tokenizer.render_messages(messages[:first], add_generation_prompt=True)
    response: list[int] = []
    mask: list[int] = []
    for m in messages[first:]:
        if m["role"] == "assistant":
            ids = [*assistant_turn_ids(m["content"], tokenizer)]
            mask += [1] * len(ids)
        else:
            ids = (
                tokenizer.end_of_turn_suffix()
                + tokenizer.render_turn(m["role"], m["content"])
                + tokenizer.generation_prompt()
            )
            mask += [0] * len(ids)
        response += ids
    return prompt, response, mask


def assistant_turn_ids(content: str, tokenizer: ChatTokenizer) -> list[int]:
    """The ids of one ideal assistant turn, ending with the end-of-turn token."""
    return [*tokenizer.encode(content), tokenizer.end_of_turn_id]


def sft_examples(
    env_spec: str | dict, seeds: Sequence[int], tokenizer: ChatTokenizer
) -> list[dict[str, list[int]]]:
    """``{"prompt_ids", "response_ids", "loss_mask"}`` of the demonstration of each seed of an
    environment spec (registered name, dotted path, {name, kwargs} or YAML file)."""
    from megatron_earl.envs.base import ENVS

    env = ENVS.build(env_spec)
    out = []
    for seed in seeds:
        prompt, response, mask = demonstration_tokens(env.demonstration(seed), tokenizer)
        out.append({"prompt_ids": prompt, "response_ids": response, "loss_mask": mask})
    return out
