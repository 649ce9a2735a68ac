"""SDPA core attention: equals Megatron's local DotProductAttention (logits and gradients), packed
(thd) sequences equal the same sequences run one by one (both within the fp32 bounds of the same
sums in another order: ``tests/tolerances.py``), and a 32K-token forward of a tiny model stays
within a stated memory bound (no s x s score matrix)."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.models.tree_attention import padding_groups
from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import fp32_tol, gpt_terms

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=128,
    add_qkv_bias=True,
)
SEQ, NUM_TOKENS = 40, 104  # the longest sequence, the most tokens (the "batched" packing) below
TOL = fp32_tol(gpt_terms(MODEL, SEQ, grad_tokens=NUM_TOKENS), 1.0)
"""Differences relative to the compared tensor's largest |entry| (logits, one parameter's
gradient): the fp32 bound of a forward and a backward over <= 104 tokens (~3e3 terms: ~3.6e-4).
Attention over the wrong keys (a mask or a sequence boundary off) moves them by O(1)."""


def _build(model: ModelConfig, weights=None):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import full_state_dict, load_full_state_dict

    use_layout(ParallelLayout(tp=torch.distributed.get_world_size()))
    runtime.seed(7)
    (chunk,) = build_model(model)
    if weights is not None:
        load_full_state_dict([chunk], weights)
    if weights is None and torch.distributed.get_world_size() == 1:
        weights = full_state_dict([chunk])
    return chunk, weights


def _logits_and_grads(backend: str, weights, tokens):
    import dataclasses

    chunk, weights = _build(dataclasses.replace(MODEL, attention_backend=backend), weights)
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    logits = chunk(tokens, positions, None)
    (logits.float() ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    core = type(chunk.decoder.layers[0].self_attention.core_attention).__name__
    return weights, logits.detach(), grads, core


def _compare_backends(tokens):
    weights, ref_logits, ref_grads, ref_core = _logits_and_grads("local", None, tokens)
    _, logits, grads, core = _logits_and_grads("sdpa", weights, tokens)
    return (
        ref_core,
        core,
        _relative_diff(logits, ref_logits),
        {n: _relative_diff(grads[n], ref_grads[n]) for n in grads},
    )


def _relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return (got - want).abs().max().item() / want.abs().max().item()


def test_sdpa_matches_local_attention():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (2, SEQ), generator=gen)
    ref_core, core, logit_diff, grad_diffs = run_distributed(
        _compare_backends, 1, args=(tokens,), timeout_s=120
    )[0]
    assert (ref_core, core) == ("DotProductAttention", "SDPAttention")
    assert logit_diff <= TOL
    assert max(grad_diffs.values()) <= TOL, grad_diffs


def _packed_vs_separate(lengths):
    """Max |diff| of the logits and of each parameter's gradient (of the summed squared logits)
    between the packed forward/backward and the sequences run one by one, relative to the largest
    |entry| of the one-by-one run's tensor."""
    from megatron.core.packed_seq_params import PackedSeqParams

    chunk, _ = _build(MODEL)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, MODEL.vocab_size, (n,), generator=gen) for n in lengths]
    separate = [chunk(s[None], torch.arange(len(s))[None], None)[0] for s in seqs]
    sum(((x.float() ** 2).sum() for x in separate), torch.zeros(())).backward()
    ref_grads = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    chunk.zero_grad()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    packed_tokens = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = chunk(packed_tokens, positions, None, packed_seq_params=params)[0]
    (packed.float() ** 2).sum().backward()
    grad_diff = max(_relative_diff(p.grad, ref_grads[n]) for n, p in chunk.named_parameters())
    return _relative_diff(packed, torch.cat(separate)), grad_diff


@pytest.mark.parametrize("world_size", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize(
    "lengths", [[5, 17, 1, 33], [16, 17, 5, 15, 33, 17, 1]], ids=["long-tail", "batched"]
)
def test_packed_sequences_equal_separate_sequences(world_size, lengths):
    """Sequences of similar length are attended in one padded batch, a long tail alone."""
    diffs = run_distributed(_packed_vs_separate, world_size, args=(lengths,), timeout_s=120)
    assert max(d[0] for d in diffs) <= TOL
    assert max(d[1] for d in diffs) <= TOL


@pytest.mark.parametrize(
    "lengths,groups",
    [
        ([16, 17, 15, 17], [[1, 3, 0, 2]]),  # similar lengths: one padded batch
        ([33, 17, 5, 1], [[0], [1], [2], [3]]),  # a long tail: each alone
        ([100, 10, 10, 10, 9], [[0], [1, 2, 3, 4]]),
        ([], []),
    ],
)
def test_padding_groups_bound_the_waste(lengths, groups):
    assert padding_groups(lengths) == groups


LONG_MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    vocab_size=128,
    max_position_embeddings=32768,
)
MEMORY_BOUND_MB = 1024
"""Peak RSS growth allowed for a 32K-token forward. One fp32 32K x 32K score matrix per head would
be 4 GiB (x4 heads); the activations of this model at 32K are ~100 MB."""


def _long_forward(seq_len: int):
    import resource

    chunk, _ = _build(LONG_MODEL)
    chunk.eval()
    tokens = torch.randint(0, LONG_MODEL.vocab_size, (1, seq_len))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with torch.no_grad():
        logits = chunk(tokens, torch.arange(seq_len)[None], None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return tuple(logits.shape), peak - before, bool(torch.isfinite(logits).all())


def test_32k_forward_within_memory_bound():
    shape, grew_mb, finite = run_distributed(_long_forward, 1, args=(32768,), timeout_s=300)[0]
    assert shape == (1, 32768, LONG_MODEL.padded_vocab_size)
    assert finite
    assert grew_mb < MEMORY_BOUND_MB, f"32K forward grew peak RSS by {grew_mb:.0f} MB"
