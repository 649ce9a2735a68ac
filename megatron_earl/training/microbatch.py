"""Token-budget micro-batching (pure): packed samples -> the model's packed (thd) micro-batches.

A **sample** is a dict of 1-D per-token tensors of one length L, aligned on *input positions*:

- ``tokens`` [L] (int): the model input (prompt, model turns, tool/environment turns);
- ``labels`` [L] (int): the next token, ``labels[t] = tokens[t + 1]`` (any valid id at the end);
- ``loss_mask`` [L]: non-zero where ``labels[t]`` is model-generated (trainable);
- any other per-token field (``advantages``, ``old_logprobs``, ``ref_logprobs``,
  ``rollout_logprobs`` ...) aligned like ``labels``: the value for predicting ``labels[t]``.

``next_token_sample`` builds that from a trajectory stored token by token (a generated-token mask
and e.g. the rollout engine's per-token log-probs, both aligned with ``tokens``).

Micro-batches are built by a per-rank **token budget**, not a sample count, by the one planner
the dispatcher uses (``dispatch.plan.balance_micro_batches``; ``plan_micro_batches`` here is its
entry for a list of lengths, with errors naming the sample): the number of micro-batches is the
one first-fit-decreasing packing needs, then samples are re-spread over that many micro-batches
largest-first onto the lightest one, so the micro-batches carry similar token counts. A sample is
never split across micro-batches (attention needs it whole). In the RL loop the dispatcher has
already planned and packed the micro-batches on the consuming rank; the loop turns each into the
model's form with ``thd_micro_batch`` (views when cp = 1), or as a prefix tree
(``training.prefix_tree``, gathered), never unpacking it into samples.

``thd_micro_batch`` makes packed per-token fields (samples back to back) one row ``[1, t]`` with
``HostPackedSeqParams(qkv_format="thd")`` (Megatron's ``PackedSeqParams`` with the boundaries as
host ints as well, so that neither the layers nor these helpers read them back from the device:
``models.packed_attention``); with cp > 1 every sample is padded to a multiple of
``2 * cp`` (``parallel.cp.cp_padded_length``; padding has ``loss_mask`` 0) and
``split_micro_batch`` keeps this CP rank's chunks (``parallel.cp.split_batch_for_cp``). Under
sequence parallelism (``sp`` = tp) the last sample is padded further so each CP rank's share
divides by tp: at most ``2 * cp * (tp - 1)`` tokens per micro-batch, outside the dispatcher's
token budget.
``pack_micro_batch`` does the same for a list of per-sample dicts (tests, SFT, profiling).
A packed micro-batch dict holds ``tokens``, ``labels``, ``position_ids``, ``loss_mask`` (float),
``seq_ids`` (the sample's slot in the micro-batch for every token, its CP padding included: then
every CP rank holds a token of every sample and per-sample sums have the same shape on all CP
ranks; padding adds 0 since its mask is 0), the other per-token fields ``[1, t]``,
``packed_seq_params`` and ``sample_index`` (the samples' indices in the caller's list, or their
sample ids for a dispatched micro-batch).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_earl import runtime
from megatron_earl.dispatch.plan import balance_micro_batches
from megatron_earl.models.packed_attention import HostPackedSeqParams, host_bounds
from megatron_earl.models.tree_attention import is_tree
from megatron_earl.parallel.cp import (
    cp_padded_length,
    merge_cp_shards,
    sequence_parallel_padding,
    split_batch_for_cp,
)

Sample = Mapping[str, torch.Tensor]
REQUIRED_FIELDS = ("tokens", "labels", "loss_mask")
INT_FIELDS = ("tokens", "labels")
ROUTES = "routed_experts"
"""The per-token routes of an MoE model's rollout (``[L, layers, topk]`` expert ids, -1 where the
engine computed no route: ``models.routing``); kept integer, padded with -1."""


class MicroBatchError(ValueError):
    """Samples that cannot be micro-batched as asked; the message names the values involved."""


def next_token_sample(
    tokens: torch.Tensor, generated: torch.Tensor, **token_fields: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A sample (input-position aligned) from a trajectory stored token by token.

    ``generated`` [L] marks model-generated tokens; each of ``token_fields`` [L] is aligned with
    ``tokens`` (e.g. ``rollout_logprobs[t] = log p(tokens[t])`` from the engine). Position t then
    predicts ``tokens[t + 1]``: it is trainable iff that token was generated; the last position
    predicts nothing (label 0, mask 0).
    """
    if tokens.dim() != 1 or tokens.numel() < 1:
        raise MicroBatchError(f"tokens must be 1-D with >= 1 token; got {tuple(tokens.shape)}")
    for name, t in {"generated": generated, **token_fields}.items():
        if t.shape != tokens.shape:
            raise MicroBatchError(f"{name} shape {tuple(t.shape)} != tokens {tuple(tokens.shape)}")

    def shift(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[1:], t.new_zeros(1)])

    out = {"tokens": tokens, "labels": shift(tokens), "loss_mask": shift(generated.float())}
    out.update({k: shift(v) for k, v in token_fields.items()})
    return out


def sample_length(sample: Sample) -> int:
    return int(sample["tokens"].numel())


def check_samples(samples: Sequence[Sample]) -> None:
    """Raise ``MicroBatchError`` for a sample without the required fields, an empty sample, or
    fields of different lengths/kinds than the first sample's."""
    if not samples:
        return
    names = set(samples[0])
    for i, s in enumerate(samples):
        missing = [f for f in REQUIRED_FIELDS if f not in s]
        if missing or set(s) != names:
            raise MicroBatchError(
                f"sample {i} has fields {sorted(s)}; every sample needs {list(REQUIRED_FIELDS)} "
                f"and the same fields as sample 0 ({sorted(names)})"
            )
        n = sample_length(s)
        if n < 1:
            raise MicroBatchError(f"sample {i} has 0 tokens; a sample needs >= 1 token")
        bad = {k: tuple(v.shape) for k, v in s.items() if v.shape != (n,)}
        if bad:
            raise MicroBatchError(f"sample {i}: fields {bad} are not 1-D of length {n} (tokens)")


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, cp: int = 1) -> list[list[int]]:
    """Sample indices per micro-batch under a per-rank budget of ``max_tokens`` tokens.

    A sample costs ``cp_padded_length(len, cp) / cp`` tokens on each CP rank. The micro-batch count
    is first-fit-decreasing's; samples are then spread largest-first onto the lightest micro-batch
    that has room (balanced token counts). Indices inside a micro-batch are ascending.
    """
    if max_tokens < 1:
        raise MicroBatchError(f"max_tokens={max_tokens}; valid: >= 1 tokens per rank")
    if not lengths:
        return []
    cost = [cp_padded_length(n, cp) // cp for n in lengths]
    over = [i for i, c in enumerate(cost) if c > max_tokens]
    if over:
        i = max(over, key=lambda i: cost[i])
        raise MicroBatchError(
            f"sample {i} has {lengths[i]} tokens ({cost[i]} per rank at cp={cp}), above the "
            f"micro-batch budget max_tokens={max_tokens} ({len(over)} such sample(s): "
            f"{over[:8]}); raise max_tokens to >= {cost[i]} or use a layout with more cp"
        )
    return balance_micro_batches(range(len(lengths)), dict(enumerate(lengths)), cp, max_tokens)


def thd_micro_batch(
    fields: Mapping[str, torch.Tensor],
    lengths: Sequence[int],
    cp: int = 1,
    sample_index: Sequence[int] | None = None,
    sp: int = 1,
) -> dict[str, object]:
    """The packed (thd) micro-batch of samples held back to back (whole, not CP-split).

    ``fields`` are per-token tensors ``[sum(lengths)]`` (e.g. a dispatched micro-batch's;
    ``routed_experts`` ``[sum(lengths), layers, topk]``); ``sample_index`` labels the samples
    (default ``0..n-1``). ``tokens``/``labels`` become int64, ``routed_experts`` keeps its
    dtype, the rest become float32 (no copy when they already are). With cp > 1 each sample is
    padded to ``cp_padded_length`` with token 0, loss mask 0, the sample's seq id, routes -1 and
    zeros elsewhere.
    ``sp`` > 1 (the model's tp under sequence parallelism) pads the last sample further, the same
    way, so each CP rank's share divides by ``sp`` (``parallel.cp.sequence_parallel_padding``).
    """
    if not lengths:
        raise MicroBatchError("a micro-batch needs at least one sample")
    padded = [cp_padded_length(n, cp) for n in lengths]
    padded[-1] += sequence_parallel_padding(padded, cp, sp)
    # The layout of the packed row is computed on the host from Python ints and moved to the
    # compute device once (boundary "packing metadata", docs/devices.md).
    cu = torch.tensor([0, *itertools.accumulate(padded)], dtype=torch.int32)
    cu_real = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    slots = torch.arange(len(lengths))
    seq_ids = torch.repeat_interleave(slots, torch.tensor(padded))
    starts = cu[:-1].long()
    real = None
    if padded != list(lengths):  # where the real tokens sit in the padded row
        real = torch.arange(int(cu_real[-1])) + torch.repeat_interleave(
            starts - cu_real[:-1].long(), torch.tensor(list(lengths))
        )
        real = runtime.to_device(real)
    position_ids = torch.arange(int(cu[-1])) - starts[seq_ids]
    out: dict[str, object] = {}
    for name, t in fields.items():
        if name != ROUTES:  # routes keep their small integer type (widened per chunk)
            t = t.long() if name in INT_FIELDS else t.float()
        t = runtime.to_device(t)
        if real is not None:
            pad = -1 if name == ROUTES else 0
            t = t.new_full((int(cu[-1]), *t.shape[1:]), pad).index_copy_(0, real, t)
        out[name] = t.unsqueeze(0)
    out["seq_ids"] = runtime.to_device(seq_ids).unsqueeze(0)
    out["position_ids"] = runtime.to_device(position_ids).unsqueeze(0)
    cu, cu_real = runtime.to_device(cu), runtime.to_device(cu_real)
    out["packed_seq_params"] = HostPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real,
        cu_seqlens_kv=cu_real,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
        bounds=(0, *itertools.accumulate(padded)),
        lengths=tuple(lengths),
    )
    # sample_index stays on the host: it is read by Python (scatter of results by sample).
    index = range(len(lengths)) if sample_index is None else sample_index
    out["sample_index"] = torch.tensor(list(index), dtype=torch.long)
    return out


def pack_micro_batch(
    samples: Sequence[Sample], indices: Sequence[int], cp: int = 1, sp: int = 1
) -> dict[str, object]:
    """One packed (thd) micro-batch of ``samples[i] for i in indices`` (``thd_micro_batch`` of
    their concatenation; ``sample_index`` = ``indices``)."""
    if not indices:
        raise MicroBatchError("a micro-batch needs at least one sample")
    chosen = [samples[i] for i in indices]
    fields = {name: torch.cat([s[name] for s in chosen]) for name in chosen[0]}
    return thd_micro_batch(fields, [sample_length(s) for s in chosen], cp, indices, sp)


def split_micro_batch(micro_batch: dict[str, object], cp: int, cp_rank: int) -> dict[str, object]:
    """This CP rank's share of a packed micro-batch (every per-token tensor; cu_seqlens stay the
    global padded boundaries, as the CP attention and Megatron's thd RoPE expect)."""
    if cp == 1:
        return dict(micro_batch)
    params = micro_batch["packed_seq_params"]
    assert isinstance(params, PackedSeqParams)
    return split_batch_for_cp(micro_batch, cp, cp_rank, cu_seqlens_padded=host_bounds(params)[0])


def build_micro_batches(
    samples: Sequence[Sample], max_tokens: int, cp: int = 1, sp: int = 1
) -> list[dict[str, object]]:
    """Check, plan and pack ``samples`` into whole (not CP-split) packed micro-batches."""
    check_samples(samples)
    plan = plan_micro_batches([sample_length(s) for s in samples], max_tokens, cp)
    return [pack_micro_batch(samples, mb, cp, sp) for mb in plan]


def num_sample_tokens(micro_batch: Mapping[str, object]) -> int:
    """The tokens of a packed micro-batch's samples, padding excluded (a tree row's counted as
    if packed whole)."""
    params = micro_batch["packed_seq_params"]
    assert isinstance(params, PackedSeqParams)
    if is_tree(params):
        return sum(params.sample_lengths)
    return sum(host_bounds(params)[1])


def num_shared_tokens(micro_batch: Mapping[str, object]) -> int:
    """Sample tokens a packed micro-batch holds once for several samples (a prefix tree's shared
    prompts, ``training.prefix_tree``); 0 for whole samples."""
    params = micro_batch["packed_seq_params"]
    return params.num_shared_tokens if is_tree(params) else 0


def real_tokens(values: torch.Tensor, micro_batch: Mapping[str, object]) -> torch.Tensor:
    """The real tokens ``[sum(lengths)]`` (CP padding dropped, packed order) of a per-token
    result ``[1, t]`` of the whole micro-batch: the per-token field form of a dispatched batch."""
    params = micro_batch["packed_seq_params"]
    assert isinstance(params, PackedSeqParams)
    if is_tree(params):  # a tree row (training.prefix_tree)
        return values.reshape(-1)[params.unshared_index]
    padded, lengths = host_bounds(params)
    if [b - a for a, b in itertools.pairwise(padded)] == lengths:
        return values.reshape(-1)
    return torch.cat(unpack_per_sample(values, micro_batch))


def unpack_per_sample(
    values: torch.Tensor, micro_batch: Mapping[str, object]
) -> list[torch.Tensor]:
    """Per-sample 1-D views (real tokens only, in the micro-batch's sample order) of a per-token
    result ``[1, t]`` of the whole micro-batch (merge CP ranks' results first: ``merge_cp``)."""
    params = micro_batch["packed_seq_params"]
    assert isinstance(params, PackedSeqParams)
    if is_tree(params):  # a tree row: gathered per sample
        return list(torch.split(real_tokens(values, micro_batch), list(params.sample_lengths)))
    starts, lengths = host_bounds(params)
    row = values.reshape(-1)
    return [row[a : a + n] for a, n in zip(starts[:-1], lengths, strict=True)]


def merge_cp(shards: Sequence[torch.Tensor], micro_batch: Mapping[str, object]) -> torch.Tensor:
    """A per-token result of the whole micro-batch from the CP ranks' local results (index = CP
    rank), each ``[1, t / cp]``; inverse of ``split_micro_batch``."""
    if len(shards) == 1:
        return shards[0]
    params = micro_batch["packed_seq_params"]
    assert isinstance(params, PackedSeqParams)
    return merge_cp_shards(list(shards), cu_seqlens_padded=host_bounds(params)[0])
