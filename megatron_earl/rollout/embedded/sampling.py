"""Token sampling and rollout log-probs for the embedded engine, vectorised over the step's rows
(pure torch, no communication).

Log-probs: ``log_softmax`` of the *raw* logits (before temperature, top-k, top-p) over the *real*
vocabulary (ids ``< vocab_size``; Megatron's padding rows excluded), in fp32: what the trainer
computes (``training.logprobs.head_logprobs`` with ``vocab_size``), what SGLang and transformers
compute on the HF model (whose vocabulary is the real one), so the rollout/train mismatch of the
same weights is ~1e-7 in fp32. The sampling distribution
itself excludes the padded ids (``>= vocab_size``), applies temperature, then top-k, then top-p,
then min-p (SGLang's rule: drop a token whose probability after temperature is below ``min_p``
times the most likely one's; done on the scaled logits as ``logit < max + log(min_p)``, only when
some row of the step asks for it), each row with its own settings. Temperature 0 is greedy
(argmax over the real vocabulary), and so is any temperature below ``SAMPLING_EPS`` (SGLang's
rule; dividing by 1e-300 would overflow). A ``top_k`` over the vocabulary keeps it whole.

Sampling is inverse-CDF: one uniform number per request from that request's own random stream
(``random.Random``: its seed, or the engine's stream), scaled by the row's total mass and looked
up in the cumulative ``softmax(filtered_logits)`` of the whole batch at once (``searchsorted``).
A seeded request therefore samples the same tokens whatever else shares its batch, a batch is a
few vectorised ops (no loop of ``multinomial`` calls, no vocabulary-sized noise per row), and a
filtered-out token (probability 0) is never drawn: the draw lies in ``(0, mass]``.

Host/device: the logits stay where the model computed them. The uniform draws are made on the
host (the requests' own streams, reproducible whatever the device) and cross to the device
(``runtime.to_device``: pinned, non-blocking on CUDA); the chosen ids and their log-probs come
back in one read of ``2 x n`` float64 values (``sample_tokens``) -- the step's only device ->
host sync, of 16 bytes per row whatever the vocabulary. Which filters run is decided from the
requests' settings on the host, never by reading a device value.

Legend: n = rows (requests) in the step, V = padded vocabulary, Vr = real vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from megatron_earl import runtime
from megatron_earl.config.sampling import SamplingParams


def host_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (indices, draws, settings) on ``device``: through ``runtime.to_device``
    (pinned, non-blocking on CUDA: no stream sync) when that is the compute device."""
    if device.type == "cpu":
        return tensor
    return runtime.to_device(tensor) if device == runtime.device() else tensor.to(device)


def filter_logits(
    logits_nVr: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
    active: tuple[bool, bool] | None = None,
) -> torch.Tensor:
    """Temperature, then top-k (``top_k < 1`` = off), then top-p, then min-p (None or 0 = off),
    per row; ``temperature > 0``. Filtered-out entries are ``-inf``. ``active``: whether some
    row uses top-k and whether some row uses top-p, when the caller knows (no device read);
    None reads it from the tensors. A ``min_p`` tensor is applied as given (0 keeps all)."""
    scaled = logits_nVr.float() / temperature[:, None]
    if min_p is not None:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf keeps all.
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p.float())[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    vocab = scaled.size(-1)
    k_on, p_on = (top_k >= 1) & (top_k < vocab), top_p < 1.0
    any_k, any_p = active if active is not None else (bool(k_on.any()), bool(p_on.any()))
    if not any_k and not any_p:
        return scaled
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    if any_k:
        ordered = ordered.masked_fill(k_on[:, None] & (rank >= top_k[:, None]), float("-inf"))
    if any_p:
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first one always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        ordered = ordered.masked_fill(p_on[:, None] & drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, ordered)


def sample_tokens(
    logits_nV: torch.Tensor,
    vocab_size: int,
    params: Sequence[SamplingParams],
    generators: Sequence[random.Random],
) -> tuple[list[int], list[float]]:
    """One token per row and its log-prob under the raw-logit distribution over the real vocab,
    read to the host in one transfer (``sample_on_device``)."""
    drawn = sample_on_device(logits_nV, vocab_size, params, generators).tolist()
    return [int(t) for t in drawn[0]], drawn[1]


def sample_on_device(
    logits_nV: torch.Tensor,
    vocab_size: int,
    params: Sequence[SamplingParams],
    generators: Sequence[random.Random],
) -> torch.Tensor:
    """``[2, n]`` float64 on the logits' device: row 0 the sampled ids (exact: ids < 2**53), row
    1 their log-probs. Reads nothing from the device."""
    if logits_nV.size(-1) < vocab_size:
        raise ValueError(f"logits have {logits_nV.size(-1)} entries < vocab_size {vocab_size}")
    if not len(params) == len(generators) == logits_nV.size(0):
        raise ValueError(
            f"{logits_nV.size(0)} logit rows need as many params and generators, got "
            f"{len(params)} and {len(generators)}"
        )
    logits_nV = logits_nV.float()
    real = logits_nV[:, :vocab_size]
    hot = [i for i, p in enumerate(params) if not p.greedy]
    every = bool(hot) and len(hot) == len(params)  # every row sampled: no argmax, no row index
    tokens = None if every else torch.argmax(real, dim=-1)
    if hot:
        rows = None if every else host_to(torch.tensor(hot, dtype=torch.long), real.device)
        filtered = _filtered(real if rows is None else real[rows], [params[i] for i in hot])
        cdf = torch.softmax(filtered, dim=-1).cumsum(dim=-1)
        draws = torch.tensor([1.0 - generators[i].random() for i in hot], dtype=cdf.dtype)
        draws = host_to(draws, cdf.device)
        picked = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None])[:, 0]
        picked = picked.clamp_(max=vocab_size - 1)
        if tokens is None:
            tokens = picked
        else:
            tokens[rows] = picked
    logprobs = torch.log_softmax(real, dim=-1).gather(1, tokens[:, None])[:, 0]
    return torch.stack([tokens.double(), logprobs.double()])


def _filtered(logits_mVr: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``filter_logits`` of the sampled rows with their settings. The usual step -- every row
    with the same filter settings, as in an RL batch -- builds them with ``torch.full``, not row
    by row, and with no top-k, top-p or min-p it only divides by the temperature (the same
    division ``filter_logits`` makes, without its checks)."""
    m, vocab, device = logits_mVr.size(0), logits_mVr.size(-1), logits_mVr.device
    first = params[0]
    same = (first.temperature, first.top_k, first.top_p, first.min_p)
    if all(p is first or (p.temperature, p.top_k, p.top_p, p.min_p) == same for p in params):
        # float64 first, as the row-by-row settings: a finite temperature beyond float32's range
        # (1e308) becomes inf (every token equally likely), not an error
        temperature = torch.full((m,), first.temperature, dtype=torch.float64, device=device)
        temperature = temperature.float()
        if not 1 <= first.top_k < vocab and first.top_p >= 1.0 and first.min_p <= 0:
            return logits_mVr.float() / temperature[:, None]
        return filter_logits(
            logits_mVr,
            temperature,
            torch.full((m,), min(first.top_k, vocab), dtype=torch.long, device=device),
            torch.full((m,), first.top_p, dtype=torch.float64, device=device).float(),
            torch.full((m,), first.min_p, dtype=torch.float64, device=device)
            if first.min_p > 0
            else None,
            active=(1 <= first.top_k < vocab, first.top_p < 1.0),
        )
    settings = torch.tensor(
        [[p.temperature, min(p.top_k, vocab), p.top_p, p.min_p] for p in params],
        dtype=torch.float64,
    )
    settings = host_to(settings, device)
    return filter_logits(
        logits_mVr,
        settings[:, 0].float(),
        settings[:, 1].long(),
        settings[:, 2].float(),
        settings[:, 3] if any(p.min_p > 0 for p in params) else None,
        active=(
            any(1 <= p.top_k < vocab for p in params),
            any(p.top_p < 1.0 for p in params),
        ),
    )


def logprob_mismatch(
    rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """Rollout/train mismatch metrics over the (masked) tokens: max and mean |diff|, and
    the mean importance ratio exp(train - rollout)."""
    diff = (train.float() - rollout.float()).detach()
    if mask is not None:
        diff = diff[mask.bool()]
    if diff.numel() == 0:
        return {"mismatch_max_abs": 0.0, "mismatch_mean_abs": 0.0, "mismatch_ratio_mean": 1.0}
    return {
        "mismatch_max_abs": float(diff.abs().max()),
        "mismatch_mean_abs": float(diff.abs().mean()),
        "mismatch_ratio_mean": float(diff.exp().mean()),
    }
