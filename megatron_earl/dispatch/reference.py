"""Test and benchmark helpers: agentic-like random batches and a naive reference of what each
destination rank must end up with (computed from the whole batch in one place, no routing).

``agentic_lengths`` draws long-tailed lengths like multi-turn agent trajectories at a 32K context
(log-normal body, a tail of runs that hit the context cap). ``agentic_schema`` is the RL batch:
int64 tokens, bool loss mask, three float32 log-prob fields, uint8 turn ids, and per-sample reward,
advantage (float32) and policy version (int64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_earl.dispatch.batch import Batch, FieldSpec, Schema
from megatron_earl.dispatch.plan import DispatchPlan, cp_chunk_bounds, cp_padded_length


def agentic_schema() -> Schema:
    return tuple(
        sorted(
            [
                FieldSpec("tokens", torch.int64, True),
                FieldSpec("loss_mask", torch.bool, True),
                FieldSpec("rollout_logprobs", torch.float32, True),
                FieldSpec("old_logprobs", torch.float32, True),
                FieldSpec("ref_logprobs", torch.float32, True),
                FieldSpec("turn_ids", torch.uint8, True),
                FieldSpec("rewards", torch.float32, False),
                FieldSpec("advantages", torch.float32, False),
                FieldSpec("policy_version", torch.int64, False),
            ],
            key=lambda s: s.name,
        )
    )


def agentic_lengths(num: int, max_len: int = 32768, seed: int = 0, min_len: int = 64) -> list[int]:
    """Long-tailed lengths: log-normal around max_len/8, ~5% of runs hitting the cap."""
    gen = torch.Generator().manual_seed(seed)
    body = torch.exp(torch.randn(num, generator=gen) * 0.9) * (max_len / 8)
    capped = torch.rand(num, generator=gen) < 0.05
    lengths = torch.where(capped, torch.full_like(body, max_len), body)
    return [int(x) for x in lengths.clamp(min_len, max_len)]


def random_sample(schema: Schema, length: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random values for every field (fills all bits that matter; bitwise comparable)."""
    out = {}
    for s in schema:
        shape = (length, *s.trailing) if s.per_token else s.trailing
        if s.dtype == torch.bool:
            out[s.name] = torch.rand(shape, generator=gen) < 0.5
        elif s.dtype.is_floating_point:
            out[s.name] = torch.randn(shape, generator=gen).to(s.dtype)
        else:
            hi = 250 if s.dtype == torch.uint8 else 50_000
            out[s.name] = torch.randint(0, hi, shape, generator=gen, dtype=s.dtype)
    return out


def make_batches(
    schema: Schema,
    lengths: Sequence[int],
    owners: Sequence[Sequence[int]],
    seed: int = 0,
    group_size: int = 1,
    only_rank: int | None = None,
) -> tuple[dict[int, dict[str, torch.Tensor]], list[Batch]]:
    """Samples (id -> fields) and each rank's ``Batch``; ``owners[r]`` lists the sample ids rank
    ``r`` holds (a sample listed on several ranks is a replica with the same values). Values depend
    only on (seed, sample id); with ``only_rank`` only that rank's samples are generated."""
    wanted = set(range(len(lengths))) if only_rank is None else set(owners[only_rank])
    samples = {}
    for sid in sorted(wanted):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + sid)
        samples[sid] = random_sample(schema, lengths[sid], gen)
    ranks = range(len(owners)) if only_rank is None else [only_rank]
    batches = [
        Batch.from_samples(
            [samples[s] for s in owners[r]],
            list(owners[r]),
            schema,
            [s // group_size for s in owners[r]],
        )
        for r in ranks
    ]
    return samples, batches


def expected_local(
    plan: DispatchPlan, samples: dict[int, dict[str, torch.Tensor]], rank: int
) -> list[dict[str, torch.Tensor]]:
    """What ``rank`` must hold per micro-batch: for each of its stage's fields, per-token fields
    as the concatenation of each sample's padded sequence cut at ``cp_chunk_bounds``, per-sample
    fields stacked."""
    layout = plan.destination.layout
    c = layout.coord(rank)
    names = plan.destination.stage_fields(plan.schema, c.pp)
    out = []
    for mb in plan.micro_batches[c.dp]:
        fields = {}
        for s in plan.schema:
            if s.name not in names:
                continue
            if not s.per_token:
                fields[s.name] = torch.stack([samples[sid][s.name] for sid in mb])
                continue
            parts = []
            for sid in mb:
                full = samples[sid][s.name]
                n = full.shape[0]
                bounds = cp_chunk_bounds(n, layout.cp, c.cp)
                padded_len = cp_padded_length(n, layout.cp)
                pad = torch.full((padded_len - n, *s.trailing), s.pad_value, dtype=s.dtype)
                padded = torch.cat([full, pad])
                parts += [padded[a:b] for a, b in bounds]
            fields[s.name] = torch.cat(parts)
        out.append(fields)
    return out
