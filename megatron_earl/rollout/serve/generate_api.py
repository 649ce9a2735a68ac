"""``/generate`` of ``megatron-earl serve``: SGLang's request schema parsed into engine requests,
and results put in SGLang's response shape.

    plan = parse_generate(body, vocab_size=256, max_seq_len=1024, tokenize=encode)
    results = await asyncio.gather(*(engine.generate(r) for r in plan.requests))
    payload = plan.response(results, detokenize)      # a dict, or a list for a batch / n > 1

Every field of the pinned SGLang release's ``GenerateReqInput`` and ``SamplingParams`` (and of
its HTTP contract ``sglang/api/v1/api_types.py``) is accepted; the contract test
(``tests/unit/test_sglang_contract.py``) checks these tables against the wheel's schema. Each
field is one of:

* implemented (``*_IMPLEMENTED``): it does what SGLang does;
* ignored (``*_IGNORED``): any well-typed value; it cannot change the tokens served here (logging,
  routing and cache hints, scheduling priority, spacing around special tokens);
* neutral only (``*_NEUTRAL``): accepted at the value SGLang treats as absent (null, its
  default, an empty list/map, per-prompt lists of those); another value would change the result
  and this server cannot honour it: 400 naming the field.

Unknown fields get a 400 naming them (SGLang 0.5.23 ignores unknown top-level keys; a typo
should not pass silently). Every value the engine uses is checked for type, range and
finiteness here (``BadRequest``): nothing a request sends can raise inside the engine loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.engine import FinishReason, GenerateRequest, GenerateResult

MAX_REQUESTS = 4096
"""Sequences one ``/generate`` call may ask for at most (prompts x n)."""
MAX_STOP_COUNT = 32
"""Stop strings of one request at most (SGLang's limit)."""

GENERATE_IMPLEMENTED = frozenset(
    {
        "rid",
        "text",
        "input_ids",
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "return_prompt_token_ids",
        "stream",
    }
)
# field -> types of an accepted value (None always accepted)
GENERATE_IGNORED: dict[str, tuple[type, ...]] = {
    "session_id": (str,),
    "log_metrics": (bool,),
    "no_logs": (bool,),
    "custom_labels": (dict,),
    "conversation_id": (str,),
    "routing_key": (str,),
    "priority": (int,),
    "external_trace_header": (dict,),
    "received_time": (int, float),
    "http_worker_ipc": (str,),
    "extra_key": (str, list),
    "cache_salt": (str, list),
    "kv_hints": (dict, list),
}
ROUTER_ADDED: dict[str, tuple[type, ...]] = {"model": (str,)}
"""Fields SGLang's router (``sglang-router`` 0.3.x) adds to every ``/generate`` it forwards but
``GenerateReqInput`` lacks (SGLang's HTTP layer drops unknown keys): ignored like the others."""
GENERATE_IGNORED.update(ROUTER_ADDED)
# field -> the value SGLang takes when it is absent (null, [] and {} are neutral too)
GENERATE_NEUTRAL: dict[str, Any] = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "mm_hashes": None,
    "mm_content_hashes": None,
    "use_audio_in_video": False,
    "video_config": None,
    "modalities": None,
    "watermark": None,
    "token_ids_logprob": None,
    "return_sampling_mask": False,
    "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_indexer_topk": False,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "positional_embed_overrides": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "decode_tp_size": None,
    "routed_dp_rank": 0,
    "data_parallel_rank": 0,
    "disagg_prefill_dp_rank": 0,
    "background": False,
    "require_reasoning": False,
    "max_thinking_tokens": None,
    "return_bytes": False,
    "return_entropy": False,
    "need_wait_for_mm_inputs": None,
    "num_items_assigned": None,
    "encoder_urls": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None,
    "images_config": None,
    "mm_processor_kwargs": None,
    "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None,
}
SAMPLING_IMPLEMENTED = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "n",
        "sampling_seed",
        "ignore_eos",
        "no_stop_trim",
        "skip_special_tokens",
    }
)
SAMPLING_IGNORED: dict[str, tuple[type, ...]] = {
    "spaces_between_special_tokens": (bool,),
    "stream_interval": (int,),
}
SAMPLING_NEUTRAL: dict[str, Any] = {
    "stop_regex": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "beam_width": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "watermark": None,
    "choice": None,
    # SGLang's internal fields (set by its own normalisation, rejected by its HTTP contract)
    "stop_strs": None,
    "stop_regex_strs": None,
    "stop_str_max_len": 0,
    "stop_regex_max_len": 0,
    "is_normalized": False,
    "ebnf_full_assistant": False,
}
GENERATE_FIELDS = GENERATE_IMPLEMENTED | set(GENERATE_IGNORED) | set(GENERATE_NEUTRAL)
SAMPLING_FIELDS = SAMPLING_IMPLEMENTED | set(SAMPLING_IGNORED) | set(SAMPLING_NEUTRAL)


class BadRequest(ValueError):
    """Client error; the message goes back with HTTP 400."""


def parse_weight_version(value: Any) -> int:
    """A request's ``weight_version`` (SGLang sends a string, e.g. ``"3"``; an integer or an
    integral finite float is taken too) as an int; ``BadRequest`` for anything else
    (``"inf"``, ``1e400``, ``2.5``, ``true``)."""
    if isinstance(value, bool):
        raise BadRequest(f"weight_version {value!r} must be an integer or an integer string")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
    elif isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise BadRequest(
        f'weight_version {value!r:.80} must be an integer or an integer string (e.g. "3")'
    )


def check_fields(body: Any, allowed: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown} in {what}; accepted: {sorted(allowed)}")
    return body


def _neutral(value: Any, default: Any) -> bool:
    """SGLang treats the value as absent: null, the default, empty, or a list of those."""
    if value is None or value == default or value in ([], {}, ""):
        return True
    return isinstance(value, list) and all(_neutral(v, default) for v in value)


def _check_others(
    body: dict[str, Any], ignored: dict[str, tuple], neutral: dict[str, Any], what: str
) -> None:
    """The fields without an effect here: well-typed (ignored) or at their neutral value."""
    for name, value in body.items():
        if name in ignored and value is not None:
            types = ignored[name]
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                names = " or ".join(t.__name__ for t in types)
                raise BadRequest(f"{what}.{name} must be {names} or null, got {value!r:.80}")
        elif name in neutral and not _neutral(value, neutral[name]):
            raise BadRequest(
                f"{what}.{name}={value!r:.80} is not supported by this server (megatron-earl "
                f"serve); send it null or {neutral[name]!r} (no effect)"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole(value: Any, name: str) -> int:
    """An integer (a float with an integral value too, as JSON encoders write 4.0)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if not _is_int(value):
        raise BadRequest(f"{name} must be an integer, got {value!r:.80}")
    return value


def _number(value: Any, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number, got {value!r:.80}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name} must be true, false or null, got {value!r:.80}")
    return bool(value)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise BadRequest(f"{what} must be a list of integers, got {value!r:.80}")
    return value


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def sampling_from_json(
    raw: Any, prompt_len: int = 0, max_seq_len: int = 0, eos_token_ids: Sequence[int] = ()
) -> SamplingParams:
    """SGLang ``sampling_params`` -> ``SamplingParams`` (``n`` is read by ``parse_generate``);
    ``BadRequest`` names what is invalid (types, ranges and finiteness are checked here, so
    nothing reaches the engine loop that could make it raise). ``eos_token_ids`` (the model's,
    as SGLang's scheduler adds them) stop generation too unless ``ignore_eos``."""
    raw = check_fields(_or(raw, {}), SAMPLING_FIELDS, "sampling_params")
    _check_others(raw, SAMPLING_IGNORED, SAMPLING_NEUTRAL, "sampling_params")
    name = "sampling_params."
    stop = _or(raw.get("stop"), ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple):
        raise BadRequest(f"{name}stop must be a string or a list of strings: {stop!r:.80}")
    if len(stop) > MAX_STOP_COUNT:
        raise BadRequest(f"{name}stop has {len(stop)} strings; at most {MAX_STOP_COUNT}")
    stop_ids = _int_list(_or(raw.get("stop_token_ids"), []), f"{name}stop_token_ids")
    stop_ids += [t for t in eos_token_ids if t not in stop_ids]
    if _bool(raw.get("ignore_eos"), f"{name}ignore_eos"):
        stop_ids = []  # SGLang: ignore_eos skips every token-based stop
    _bool(raw.get("no_stop_trim"), f"{name}no_stop_trim")
    max_new = raw.get("max_new_tokens", 128)
    max_new = max(max_seq_len - prompt_len, 0) if max_new is None else max_new
    top_k = _whole(_or(raw.get("top_k"), -1), f"{name}top_k")
    fields = {
        "max_new_tokens": _whole(max_new, f"{name}max_new_tokens"),
        "temperature": _number(_or(raw.get("temperature"), 1.0), f"{name}temperature"),
        "top_p": _number(_or(raw.get("top_p"), 1.0), f"{name}top_p"),
        "top_k": top_k,
        "min_p": _number(_or(raw.get("min_p"), 0.0), f"{name}min_p"),
        "stop_token_ids": tuple(stop_ids),
        "stop": tuple(stop),
        "seed": raw.get("sampling_seed"),
    }
    try:
        return SamplingParams(**fields)
    except ValueError as err:
        raise BadRequest(f"invalid sampling_params: {err}") from None


@dataclass(frozen=True)
class Options:
    """What one sequence's response carries beyond the tokens."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    """Decode ``text`` without special tokens (SGLang's default)."""


def _decoder(detokenize: Callable[..., str], opts: Options) -> Callable[[Sequence[int]], str]:
    """``detokenize`` as the sequence's options ask; a detokenizer that keeps special tokens
    takes ``skip_special_tokens=False`` (only passed when a request asks for it)."""
    if opts.skip_special_tokens:
        return detokenize
    return lambda ids: detokenize(ids, skip_special_tokens=False)


@dataclass(frozen=True)
class GeneratePlan:
    """A parsed ``/generate`` call: the engine requests, prompt-major (n per prompt, as SGLang
    orders them), and how to answer."""

    requests: list[GenerateRequest]
    options: list[Options]
    batched: bool
    """Answer a list (a batch of prompts, or n > 1), else one object."""
    stream: bool
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False

    def response(
        self, results: Sequence[GenerateResult], detokenize: Callable[[Sequence[int]], str]
    ) -> dict[str, Any] | list[dict[str, Any]]:
        out = [self.result_json(i, r, detokenize) for i, r in enumerate(results)]
        return out if self.batched else out[0]

    def result_json(
        self, index: int, result: GenerateResult, detokenize: Callable[[Sequence[int]], str]
    ) -> dict[str, Any]:
        """One sequence's result in SGLang's shape."""
        request, opts = self.requests[index], self.options[index]
        detokenize = _decoder(detokenize, opts)
        ids = list(result.output_ids)
        meta: dict[str, Any] = {
            "id": result.rid,
            "finish_reason": finish_json(result.finish_reason, len(ids)),
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": result.cached_tokens,
            "weight_version": str(result.weight_version),
        }
        if opts.return_logprob:
            text_of = detokenize if self.return_text_in_logprobs else None
            meta.update(logprobs_json(request, result, opts, text_of))
        out = {"text": trimmed_text(ids, result.finish_reason, opts, detokenize)}
        out.update(output_ids=ids, meta_info=meta)
        if self.return_prompt_token_ids:
            out["prompt_token_ids"] = list(request.input_ids)
        return out

    def partial_json(
        self,
        index: int,
        rid: str,
        ids: list[int],
        logprobs: list[float],
        weight_version: int,
        detokenize: Callable[[Sequence[int]], str],
    ) -> dict[str, Any]:
        """A streamed sequence so far (SGLang's intermediate event: ``finish_reason`` null;
        the prompt and top log-probs come with the final event)."""
        request, opts = self.requests[index], self.options[index]
        detokenize = _decoder(detokenize, opts)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": None,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": str(weight_version),
        }
        if opts.return_logprob:
            text_of = detokenize if self.return_text_in_logprobs else None
            meta["output_token_logprobs"] = [
                [lp, tok, text_of([tok]) if text_of else None] for lp, tok in zip(logprobs, ids)
            ]
            meta["output_token_logprobs_length"] = len(ids)
        return {"text": detokenize(ids), "output_ids": list(ids), "meta_info": meta}


def parse_generate(
    body: Any,
    *,
    max_seq_len: int,
    tokenize: Callable[[str], list[int]] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> GeneratePlan:
    """A ``/generate`` body -> ``GeneratePlan``; ``BadRequest`` names what is invalid.
    ``eos_token_ids``: the served model's end-of-sequence ids (see ``sampling_from_json``)."""
    body = check_fields(body, GENERATE_FIELDS, "the /generate request")
    _check_others(body, GENERATE_IGNORED, GENERATE_NEUTRAL, "the /generate request")
    prompts, batched = _prompts(body, tokenize)
    k = len(prompts)
    raw_sampling = body.get("sampling_params")
    if isinstance(raw_sampling, list):
        if len(raw_sampling) != k or not raw_sampling:
            raise BadRequest(f"sampling_params is a list of {len(raw_sampling)}; need {k}")
    else:
        raw_sampling = [raw_sampling] * k
    for sp in raw_sampling:
        check_fields(_or(sp, {}), SAMPLING_FIELDS, "sampling_params")
    ns = {_whole(_or((sp or {}).get("n"), 1), "sampling_params.n") for sp in raw_sampling}
    if len(ns) != 1:
        raise BadRequest(f"sampling_params.n must be the same for every prompt, got {sorted(ns)}")
    n = ns.pop()
    if not 1 <= n or k * n > MAX_REQUESTS:
        raise BadRequest(f"sampling_params.n={n} x {k} prompts must be in [1, {MAX_REQUESTS}]")
    per = {
        name: _per_prompt(body.get(name), k, n, name)
        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num")
    }
    rids = _rids(body.get("rid"), k, n, batched)
    requests, options = [], []
    for i, prompt in enumerate(prompts):
        sampling = sampling_from_json(raw_sampling[i], len(prompt), max_seq_len, eos_token_ids)
        logprob = _bool(per["return_logprob"][i], "return_logprob")
        start = _whole(_or(per["logprob_start_len"][i], -1), "logprob_start_len")
        top = _whole(_or(per["top_logprobs_num"][i], 0), "top_logprobs_num")
        if not -1 <= start <= len(prompt):
            raise BadRequest(
                f"logprob_start_len={start} must be -1 or in [0, {len(prompt)}] (the prompt's "
                "length)"
            )
        if top < 0:
            raise BadRequest(f"top_logprobs_num must be >= 0, got {top}")
        opts = Options(
            return_logprob=logprob,
            logprob_start_len=start if logprob else -1,
            top_logprobs_num=top if logprob else 0,
            no_stop_trim=bool((raw_sampling[i] or {}).get("no_stop_trim")),
            skip_special_tokens=_bool(
                _or((raw_sampling[i] or {}).get("skip_special_tokens"), True),
                "sampling_params.skip_special_tokens",
            ),
        )
        for j in range(n):
            rid = rids[i * n + j]
            requests.append(
                GenerateRequest(
                    tuple(prompt),
                    sampling,
                    rid,
                    logprob_start_len=opts.logprob_start_len,
                    top_logprobs_num=opts.top_logprobs_num,
                )
            )
            options.append(opts)
    return GeneratePlan(
        requests,
        options,
        batched=batched or n > 1,
        stream=_bool(body.get("stream"), "stream"),
        return_text_in_logprobs=_bool(
            body.get("return_text_in_logprobs"), "return_text_in_logprobs"
        ),
        return_prompt_token_ids=_bool(
            body.get("return_prompt_token_ids"), "return_prompt_token_ids"
        ),
    )


def _prompts(
    body: dict[str, Any], tokenize: Callable[[str], list[int]] | None
) -> tuple[list[list[int]], bool]:
    """The prompts' token ids and whether the request is a batch."""
    if (body.get("input_ids") is None) == (body.get("text") is None):
        raise BadRequest("give exactly one of input_ids or text")
    if body.get("text") is not None:
        if tokenize is None:
            raise BadRequest("this model has no tokenizer; send input_ids")
        texts = body["text"]
        batched = isinstance(texts, list)
        texts = texts if batched else [texts]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest(f"text must be a string or a list of strings, got {texts!r:.80}")
        return [tokenize(t) for t in texts], batched
    ids = body["input_ids"]
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return [_int_list(p, "input_ids[i]") for p in ids], True
    return [_int_list(ids, "input_ids")], False


def _per_prompt(value: Any, k: int, n: int, name: str) -> list[Any]:
    """A value or one per prompt (SGLang: no per-prompt lists with n > 1)."""
    if not isinstance(value, list):
        return [value] * k
    if n > 1 or len(value) != k:
        raise BadRequest(
            f"{name} is a list of {len(value)}; give one value, or one per prompt ({k}) when n == 1"
        )
    return value


def _rids(rid: Any, k: int, n: int, batched: bool) -> list[str]:
    """One request id per sequence, prompt-major; "" lets the engine name it. A string names a
    batch's sequences ``{rid}_{i}`` (SGLang's form); a list names its prompts (``_{j}`` added
    per sample when n > 1)."""
    if isinstance(rid, list):
        if len(rid) != k or not all(isinstance(r, str) for r in rid):
            raise BadRequest(f"rid must be a string or a list of {k} strings, got {rid!r:.80}")
        if len(set(rid)) != k:
            raise BadRequest(f"duplicate request ids in rid: {rid!r:.80}")
        return [f"{r}_{j}" if n > 1 else r for r in rid for j in range(n)]
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"rid must be a string or a list of {k} strings, got {rid!r:.80}")
    if not rid:
        return [""] * (k * n)
    return [f"{rid}_{i}" for i in range(k * n)] if batched or n > 1 else [rid]


def finish_json(reason: FinishReason, length: int) -> dict[str, Any]:
    if reason.type.value == "stop":
        return {"type": "stop", "matched": reason.matched}
    if reason.type.value == "length":
        return {"type": "length", "length": length}
    return {"type": "abort", "message": reason.message}


def trimmed_text(
    ids: list[int],
    reason: FinishReason,
    opts: Options,
    detokenize: Callable[[Sequence[int]], str],
) -> str:
    """The output text as SGLang's detokenizer returns it: without the matched stop string
    (or stop token) unless ``no_stop_trim``."""
    matched = reason.matched if reason.type.value == "stop" else None
    if isinstance(matched, int) and not opts.no_stop_trim and ids:
        return detokenize(ids[:-1])
    text = detokenize(ids)
    if isinstance(matched, str) and (pos := text.find(matched)) >= 0:
        return text[: pos + len(matched)] if opts.no_stop_trim else text[:pos]
    return text


def logprobs_json(
    request: GenerateRequest,
    result: GenerateResult,
    opts: Options,
    text_of: Callable[[Sequence[int]], str] | None,
) -> dict[str, Any]:
    """SGLang's ``meta_info`` log-prob entries: ``[logprob, token_id, text | null]`` triples;
    input entries from ``logprob_start_len`` with a null first log-prob (SGLang's shape)."""

    def triple(lp: float | None, tok: int) -> list:
        return [lp, tok, text_of([tok]) if text_of else None]

    def tops(pairs: Sequence[tuple[float, int]] | None) -> list | None:
        return None if pairs is None else [triple(lp, tok) for lp, tok in pairs]

    prompt, start = request.input_ids, opts.logprob_start_len
    in_ids = prompt[start:] if 0 <= start < len(prompt) else ()
    in_lps = [None, *result.input_logprobs] if in_ids else []
    meta: dict[str, Any] = {
        "input_token_logprobs": [triple(lp, tok) for lp, tok in zip(in_lps, in_ids)],
        "output_token_logprobs": [
            triple(lp, tok) for lp, tok in zip(result.output_logprobs, result.output_ids)
        ],
        "output_token_logprobs_length": len(result.output_ids),
    }
    if opts.top_logprobs_num > 0:
        in_tops = [None, *result.input_top_logprobs] if in_ids else []
        meta["input_top_logprobs"] = [tops(t) for t in in_tops]
        meta["output_top_logprobs"] = [tops(t) for t in result.output_top_logprobs]
    return meta
