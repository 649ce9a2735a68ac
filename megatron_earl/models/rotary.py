"""RoPE in the form this project computes it: ``t * cos + roll(t, rot / 2) * signed_sin``.

Megatron's non-interleaved RoPE is ``t * cos + rotate_half(t) * sin`` with ``rotate_half(t) =
cat(-t2, t1)``; the same products come from rolling ``t`` by half the rotary dimension and
multiplying by ``signed_sin = cat(-sin_first_half, sin_second_half)``: no chunk, neg or cat of
``t`` per call. The embedded engine (``rollout.embedded.batched_forward``) and the training
attention's RoPE (``patches/rope_tables.py``) build their tables here (pure, no communication).
"""

from __future__ import annotations

import torch


def cos_signed_sin(
    freqs: torch.Tensor, mscale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos(freqs) * mscale`` and the signed ``sin(freqs) * mscale`` (module docstring), in
    ``dtype``, as Megatron's attention scales them (``freqs`` [..., rot], the rotary angles)."""
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    half = sin.size(-1) // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
