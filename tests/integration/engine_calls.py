"""Calls the integration tests make to one engine (``megatron-earl serve`` or SGLang) over its
HTTP API: the output for one request, and the weight version it reports."""

from __future__ import annotations

from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.engine import GenerateRequest
from megatron_earl.rollout.sglang.client import SGLangClient


async def outputs(
    url: str, prompt: tuple[int, ...], params: SamplingParams
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(output ids, their log-probs) of one request."""
    client = SGLangClient(url)
    try:
        result = await client.generate(GenerateRequest(prompt, params))
    finally:
        await client.close()
    return result.output_ids, result.output_logprobs


async def reported_version(url: str) -> int:
    """The weight version the engine reports (``/get_model_info``); ``EngineError`` if it does
    not answer."""
    client = SGLangClient(url)
    try:
        await client.get_model_info()
    finally:
        await client.close()
    return client.weight_version
