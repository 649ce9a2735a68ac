"""Token sampling and rollout log-probs for the embedded engine (pure torch, no communication).

Log-probs: ``log_softmax`` of the *raw* logits (before temperature, top-k, top-p) over the whole
*padded* vocabulary, in fp32: exactly what the training side computes
(``training.schedule.token_logprobs`` = ``-vocab_parallel_cross_entropy`` over the padded vocab),
so the rollout/train mismatch of the same weights is ~1e-7 in fp32. The sampling distribution
itself excludes the padded ids (``>= vocab_size``), applies temperature, then top-k, then top-p.
Temperature 0 is greedy (argmax over the real vocabulary).

Legend: n = rows (requests) in the step, V = padded vocabulary, Vr = real vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_earl.config.sampling import SamplingParams


def filter_logits(logits_Vr: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to one row of real-vocabulary logits (temperature>0)."""
    scaled = logits_Vr.float() / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first one always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


def sample_tokens(
    logits_nV: torch.Tensor,
    vocab_size: int,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> tuple[list[int], list[float]]:
    """One token per row and its log-prob under the raw-logit distribution over the padded vocab."""
    if logits_nV.size(-1) < vocab_size:
        raise ValueError(f"logits have {logits_nV.size(-1)} entries < vocab_size {vocab_size}")
    logprobs_nV = torch.log_softmax(logits_nV.float(), dim=-1)
    tokens: list[int] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        real = logits_nV[row, :vocab_size]
        if p.temperature == 0:
            token = int(torch.argmax(real))
        else:
            probs = torch.softmax(filter_logits(real, p), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        tokens.append(token)
    index = torch.tensor(tokens, dtype=torch.long)[:, None]
    return tokens, logprobs_nV.gather(1, index)[:, 0].tolist()


def logprob_mismatch(
    rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """Rollout/train log-prob mismatch metrics over the (masked) tokens: max and mean |diff|, and
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
