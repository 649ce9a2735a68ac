"""RoPE applied with one cos/sin table per forward and four ops per tensor, where Megatron's
unfused path is taken (no TE fusion).

What: ``apply()`` replaces ``apply_rotary_pos_emb`` where Megatron-Core's attention calls it
  (``megatron.core.transformer.attention``) by ``apply_rotary``. For the cases it covers -- no
  fusion, non-interleaved, not MLA, and either ``bshd`` or ``thd`` at cp = 1 with one table row
  per packed token (the prefix-tree row's "exact mapping"), or ``thd`` at any cp with a table
  marked by ``per_token_table`` (a row per token this rank holds: ``models.gpt.GPTModel``
  indexes Megatron's table by the tokens' positions for a packed micro-batch) -- it computes
  Megatron's ``t * cos + rotate_half(t) * sin`` (cos/sin scaled by mscale) as
  ``t * cos + roll(t, rot / 2) * signed_sin`` (the same products and sums, so equal values and
  gradients, ``torch.equal``; the embedded engine's formula, ``rollout.embedded.batched_forward``,
  which fuses the last two ops; both take their tables from ``models.rotary``),
  with the tables made once for the rotary tensor every layer receives (a one-entry cache keyed
  by that tensor) instead of ``cos``/``sin`` per layer and per query/key. Every other case
  (fusion, interleaved, MLA, CP, a ``thd`` table indexed by position in each sequence) runs
  Megatron's function unchanged.
Why: the unfused path is what runs on CPU and on GPUs without TE's fused RoPE. Per call it
  computes ``cos`` and ``sin`` of the table and their mscale products, splits the head dimension
  with ``chunk`` and joins it with two ``cat`` (one for an empty pass-through part), and its thd
  variant reads ``cu_seqlens`` back (``.tolist()``, ``freqs.size(0) == cu_seqlens[-1]``) and
  splits the tensor per sequence, in every layer for queries and keys (device syncs on a GPU),
  and its exact mapping reads ``cu_seqlens[i].item()`` per sequence. On the demo model these
  ops were ~5% of a train step.
Versions: megatron-core>=0.16.0,<0.17.0 (``apply_rotary_pos_emb(t, freqs, config, cu_seqlens,
  mscale, cp_group)`` imported by name into ``transformer.attention``, as in 0.16.1).
Test: tests/unit/test_rope_tables.py (values and gradients equal to Megatron's function
  (``torch.equal``) for bshd, tree and multi-sequence thd, partial rotary; the delegated cases)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_earl.models.rotary import cos_signed_sin
from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
TARGETS = (
    Target("megatron.core.transformer.attention", "apply_rotary_pos_emb"),
    Target("megatron.core.models.common.embeddings.rope_utils", "apply_rotary_pos_emb"),
)

_PER_TOKEN = "_earl_rope_per_token"
"""The attribute ``per_token_table`` sets on a rotary table."""
_ORIGINAL: list[Any] = []
"""Megatron's ``rope_utils.apply_rotary_pos_emb`` (the delegated cases)."""
_TABLES: list[tuple | None] = [None]
"""The last (weak reference to the rotary tensor, mscale, dtype, inference mode, cos, signed
sin): tables made under ``torch.inference_mode`` are never handed to a grad-enabled forward."""


def apply() -> bool:
    """Install ``apply_rotary`` in Megatron's attention module. Idempotent. Local."""
    check_targets(__name__, VERSIONS, TARGETS)
    if not _ORIGINAL:
        _ORIGINAL.append(TARGETS[1].get())
    TARGETS[0].set(apply_rotary)
    return True


def _tables(freqs: Tensor, mscale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin of ``freqs`` (x mscale, in ``dtype``), made once per rotary tensor."""
    key = (mscale, dtype, torch.is_inference_mode_enabled())
    last = _TABLES[0]
    if last is not None and last[0]() is freqs and last[1:4] == key:
        return last[4], last[5]
    cos, signed = cos_signed_sin(freqs, mscale, dtype)
    _TABLES[0] = (weakref.ref(freqs), *key, cos, signed)
    return cos, signed


def _covered(
    t: Tensor, freqs: Tensor, config: Any, cu_seqlens: Tensor | None, cp_group: ProcessGroup | None
) -> bool:
    """Whether ``apply_rotary`` computes this call itself (module docstring). A thd call without
    its CP group (Megatron would look up the global one) goes to Megatron's function."""
    if config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention:
        return False
    if cu_seqlens is None:
        return True
    if getattr(freqs, _PER_TOKEN, False):  # a row per token of t, any cp (per_token_table)
        return freqs.size(0) == t.size(0)
    # thd at cp = 1 with one table row per packed token (Megatron: freqs.size(0) == cu[-1])
    return cp_group is not None and cp_group.size() == 1 and freqs.size(0) == t.size(0)


def computes_per_token(config: Any) -> bool:
    """Whether Megatron's attention calls ``apply_rotary`` (``apply()`` ran) and it computes a
    ``per_token_table`` for ``config``'s RoPE (else a table must stay Megatron's)."""
    fused = config.apply_rope_fusion or config.rotary_interleaved
    return TARGETS[0].get() is apply_rotary and not (fused or config.multi_latent_attention)


def per_token_table(table: Tensor) -> Tensor:
    """Mark ``table`` (a rotary table indexed by every token's position in its sequence: one row
    per token this rank holds, in its order) as one ``apply_rotary`` computes at any cp, reading
    no boundaries (``models.gpt.GPTModel`` makes them for packed micro-batches)."""
    setattr(table, _PER_TOKEN, True)
    return table


def apply_rotary(
    t: Tensor,
    freqs: Tensor,
    config: Any,
    cu_seqlens: Tensor | None = None,
    mscale: float = 1.0,
    cp_group: ProcessGroup | None = None,
) -> Tensor:
    """Megatron's ``apply_rotary_pos_emb`` (module docstring): ``t`` [s, b, h, d] (bshd) or
    [t, h, d] (thd), ``freqs`` [s, 1, 1, rot]."""
    if not _covered(t, freqs, config, cu_seqlens, cp_group):
        return _ORIGINAL[0](
            t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group
        )
    cos, signed_sin = _tables(freqs, mscale, t.dtype)
    if cu_seqlens is not None:  # [t, 1, 1, rot] against [t, h, d]
        cos, signed_sin = cos[:, 0], signed_sin[:, 0]
    rot = cos.size(-1)
    head = t[..., :rot]
    # Not addcmul: a fused multiply-add rounds once where Megatron's add of two products rounds
    # twice; written this way every value and gradient equals Megatron's (torch.equal).
    rotated = head * cos + head.roll(rot // 2, dims=-1) * signed_sin
    return rotated if rot == t.size(-1) else torch.cat((rotated, t[..., rot:]), dim=-1)
