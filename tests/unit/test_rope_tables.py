"""``patches/rope_tables.py``: RoPE with one table per rotary tensor and four ops, against
Megatron-Core's unfused ``apply_rotary_pos_emb`` (values and input gradients equal,
``torch.equal``), and the cases it hands to Megatron's function unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention

from megatron_earl.patches import rope_tables

CONFIG = SimpleNamespace(
    apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False
)
CP1 = SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def _freqs(positions: torch.Tensor, rot: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = positions.float()[:, None] * inv[None]
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]  # Megatron's [s, 1, 1, rot]


def _both(t: torch.Tensor, freqs: torch.Tensor, **kwargs):
    """(ours, Megatron's) outputs and input gradients for the same upstream gradient."""
    out = []
    upstream = None
    for fn in (rope_tables.apply_rotary, rope_utils.apply_rotary_pos_emb):
        x = t.clone().requires_grad_(True)
        y = fn(x, freqs, CONFIG, **{"cp_group": CP1, **kwargs})
        upstream = torch.randn_like(y) if upstream is None else upstream
        y.backward(upstream)
        out.append((y.detach(), x.grad))
    return out


@pytest.mark.parametrize("rot", [16, 8], ids=["full", "partial"])
@pytest.mark.parametrize("mscale", [1.0, 1.3])
def test_bshd_equals_megatron(rot, mscale):
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(7, 2, 3, 16, generator=gen)
    (y, g), (y_ref, g_ref) = _both(t, _freqs(torch.arange(7), rot), mscale=mscale)
    assert torch.equal(y, y_ref) and torch.equal(g, g_ref)


@pytest.mark.parametrize("bounds", [[0, 9], [0, 4, 9]], ids=["tree_row", "two_sequences"])
def test_thd_table_per_token_equals_megatron(bounds):
    """A table of one row per packed token (a tree row: the positions of the tokens' own
    samples; or several sequences with their offsets): Megatron's exact mapping."""
    positions = torch.tensor([0, 1, 2, 3, 3, 4, 5, 3, 4])  # a prefix of 3 and two branches
    t = torch.randn(9, 4, 16, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor(bounds, dtype=torch.int32)
    (y, g), (y_ref, g_ref) = _both(t, _freqs(positions, 16), cu_seqlens=cu)
    assert torch.equal(y, y_ref) and torch.equal(g, g_ref)


def test_tables_made_once_per_rotary_tensor():
    freqs = _freqs(torch.arange(5), 8)
    first = rope_tables._tables(freqs, 1.0, torch.float32)
    assert all(a is b for a, b in zip(first, rope_tables._tables(freqs, 1.0, torch.float32)))
    assert rope_tables._tables(freqs.clone(), 1.0, torch.float32)[0] is not first[0]
    with torch.inference_mode():  # never reused by a forward that records gradients
        inner = rope_tables._tables(freqs, 1.0, torch.float32)
    assert inner[0] is not first[0]
    x = torch.randn(5, 1, 2, 8, requires_grad=True)
    rope_tables.apply_rotary(x, freqs, CONFIG, cp_group=CP1).sum().backward()
    assert x.grad is not None


def test_other_cases_run_megatrons_function(monkeypatch):
    """Per-sequence thd tables, thd at cp 2 or without its CP group, interleaved rotation:
    Megatron's own function, as given."""
    calls = []
    monkeypatch.setattr(rope_tables, "_ORIGINAL", [lambda *a, **k: calls.append(k) or a[0]])
    t = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    per_token = _freqs(torch.arange(6), 8)
    cp2 = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    rope_tables.apply_rotary(t, _freqs(torch.arange(4), 8), CONFIG, cu_seqlens=cu, cp_group=CP1)
    rope_tables.apply_rotary(t, per_token, CONFIG, cu_seqlens=cu, cp_group=cp2)
    rope_tables.apply_rotary(t, per_token, CONFIG, cu_seqlens=cu)
    interleaved = SimpleNamespace(**{**vars(CONFIG), "rotary_interleaved": True})
    rope_tables.apply_rotary(t[None], _freqs(torch.arange(1), 8), interleaved, cp_group=CP1)
    assert len(calls) == 4 and calls[0]["cu_seqlens"] is cu and calls[1]["cp_group"] is cp2


def test_installed_where_attention_calls_it():
    assert rope_tables.apply()
    assert attention.apply_rotary_pos_emb is rope_tables.apply_rotary
    assert rope_tables._ORIGINAL[0] is rope_utils.apply_rotary_pos_emb
