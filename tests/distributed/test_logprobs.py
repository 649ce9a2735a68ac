"""Chunked vocab-parallel log-probs and entropy (``training.logprobs`` via
``rl_step.forward_logprobs``) under TP2, PP2, CP2 and TP2xCP2 equal a single-process reference that
materialises the full logits of each sample (within the fp32 bound of a forward's sums in another
order: ``tests/tolerances.py``); the packed (thd) micro-batches
of different lengths need ``variable_seq_lengths`` under PP. A frozen reference policy in PP2,
loaded by reshard from a TP2 policy, gives the same log-probs. The log-prob head on a 16K-token
sequence, and the whole forward-only log-prob pass on a packed 16K-token row, stay under stated
peak-memory bounds (chunking works). The head's entropy modes ("grad", "value", "none") give the
same log-probs and, for a loss without the entropy, the same gradients."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import assert_fp32_close, gpt_terms

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=200,
    make_vocab_size_divisible_by=16,  # padded to 208: the padding rows are excluded
)
LENGTHS = [13, 7, 22, 5, 16, 9, 1]
FORWARD_TERMS = gpt_terms(MODEL, max(LENGTHS))
"""Log-probs and entropies: a forward's chain of fp32 sums, the log-softmax and the entropy over
the vocabulary included (~1.6e3 terms: ~2e-4 x |value|); a vocab shard left out of the softmax
or the padding rows let in move them by ~4e-2 (log 208/200)."""
BUDGET = 32  # tokens per rank and micro-batch: several micro-batches of different lengths
CHUNK = 8  # tokens per output-layer chunk: many chunks per micro-batch


def _samples():
    from megatron_earl.training.microbatch import next_token_sample

    gen = torch.Generator().manual_seed(5)
    return [
        next_token_sample(
            torch.randint(0, MODEL.vocab_size, (n,), generator=gen),
            torch.rand(n, generator=gen) < 0.7,
        )
        for n in LENGTHS
    ]


def _run(layout: ParallelLayout, weights, samples):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import full_state_dict, load_full_state_dict
    from megatron_earl.training.rl_step import forward_logprobs

    initialize_layout(layout)
    runtime.seed(7)
    chunks = build_model(MODEL, vpp=layout.vpp)
    if weights is None:
        weights = full_state_dict(chunks)
    load_full_state_dict(chunks, weights)
    for c in chunks:
        c.eval()
    out = forward_logprobs(
        chunks, samples, max_tokens=BUDGET, chunk_size=CHUNK, vocab_size=MODEL.vocab_size
    )
    result = {"weights": weights, "out": out}
    if layout.world_size == 1:  # unchunked reference: one sample at a time, full logits
        ref_lp, ref_ent = [], []
        with torch.no_grad():
            for s in samples:
                n = s["tokens"].numel()
                logits = chunks[0](s["tokens"][None], torch.arange(n)[None], None)[0]
                logp = torch.log_softmax(logits[:, : MODEL.vocab_size].double(), -1)
                ref_lp.append(logp.gather(1, s["labels"][:, None]).squeeze(1))
                ref_ent.append(-(logp.exp() * logp).sum(-1))
        result["reference"] = (ref_lp, ref_ent)
    return result


@pytest.fixture(scope="module")
def reference():
    (res,) = run_distributed(_run, 1, args=(ParallelLayout(), None, _samples()), timeout_s=180)
    return res


def test_single_process_chunked_equals_full_logits(reference):
    lp, ent = reference["out"]
    ref_lp, ref_ent = reference["reference"]
    for i in range(len(LENGTHS)):
        assert_fp32_close(lp[i].double(), ref_lp[i], FORWARD_TERMS)
        assert_fp32_close(ent[i].double(), ref_ent[i], FORWARD_TERMS)


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(tp=2),
        ParallelLayout(pp=2),
        ParallelLayout(cp=2),
        ParallelLayout(tp=2, cp=2),
    ],
    ids=str,
)
def test_layouts_equal_single_process(reference, layout):
    results = run_distributed(
        _run, layout.world_size, args=(layout, reference["weights"], _samples()), timeout_s=240
    )
    ref_lp, ref_ent = reference["reference"]
    last = [r["out"] for r in results if r["out"] is not None]
    assert len(last) == layout.world_size // layout.pp  # every last-stage rank has every sample
    for lp, ent in last:
        assert [t.numel() for t in lp] == LENGTHS
        for i in range(len(LENGTHS)):
            assert_fp32_close(lp[i].double(), ref_lp[i], FORWARD_TERMS)
            assert_fp32_close(ent[i].double(), ref_ent[i], FORWARD_TERMS)


def _reference_policy(weights, samples):
    """Policy in TP2, frozen reference in PP2 loaded from it by a point-to-point reshard."""
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import current_layout, initialize_layout
    from megatron_earl.redistribute.geometry import load_full_state_dict, shard_pieces
    from megatron_earl.training.reference import ReferenceConfig, ReferencePolicy
    from megatron_earl.training.rl_step import forward_logprobs

    policy_layout = ParallelLayout(tp=2)
    initialize_layout(policy_layout)
    runtime.seed(7)
    policy = build_model(MODEL)
    load_full_state_dict(policy, weights)
    config = ReferenceConfig(
        layout=ParallelLayout(pp=2),
        max_tokens_per_micro_batch=BUDGET,
        logprob_chunk_size=CHUNK,
        vocab_size=MODEL.vocab_size,
    )
    ref = ReferencePolicy(MODEL, config)
    assert current_layout() == policy_layout
    ref.load_from(shard_pieces(policy))
    ref_lp = ref.logprobs(samples)
    assert current_layout() == policy_layout  # the caller's layout is back
    policy_lp = forward_logprobs(
        policy, samples, max_tokens=BUDGET, chunk_size=CHUNK, vocab_size=MODEL.vocab_size
    )
    frozen = all(not p.requires_grad for c in ref.chunks for p in c.parameters())
    return {"ref": ref_lp, "policy": policy_lp[0], "frozen": frozen}


def test_reference_policy_in_another_layout(reference):
    results = run_distributed(
        _reference_policy, 2, args=(reference["weights"], _samples()), timeout_s=240
    )
    ref_lp, _ = reference["reference"]
    assert [r["ref"] is None for r in results] == [True, False]  # PP2: only the last stage
    for res in results:
        assert res["frozen"]
        for got in (res["policy"], *([res["ref"]] if res["ref"] is not None else [])):
            for i in range(len(LENGTHS)):
                assert_fp32_close(got[i].double(), ref_lp[i], FORWARD_TERMS)


SEQ = 16384
VOCAB = 4096
HIDDEN = 64
HEAD_CHUNK = 512
PEAK_BOUND_MIB = 96
"""Bound on the extra peak memory (RSS high-water mark over the RSS before) of the head's forward +
backward at 16K tokens. Unchunked, the fp32 logits alone would be SEQ x VOCAB x 4 B = 256 MiB, and
the softmax and its gradient need as much again each. Chunked, the head keeps two or three
HEAD_CHUNK x VOCAB buffers (8 MiB each) and O(SEQ) vectors. Measured 31-32 MiB (2 threads); the
bound leaves room for allocator noise on a loaded machine."""
PASS_BOUND_MIB = 128
"""Bound on the extra peak memory of the whole forward-only log-prob pass of a tiny model (2 layers,
hidden 64) on one packed 16K-token row (16 samples of 1024): the head as above plus the layers'
activations (a few MiB each at this width). Unchunked, the logits and their log-softmax alone
would be 512 MiB. Measured 60 MiB."""


def _head_peak_memory():
    import resource

    from megatron_earl.training.logprobs import head_logprobs

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(SEQ, HIDDEN, generator=gen).requires_grad_()
    weight = (0.02 * torch.randn(VOCAB, HIDDEN, generator=gen)).requires_grad_()
    targets = torch.randint(0, VOCAB, (SEQ,), generator=gen)
    lp, ent = head_logprobs(hidden[:64], weight, targets[:64], chunk_size=HEAD_CHUNK)
    (lp.sum() + ent.sum()).backward()  # warm-up: kernels and allocator pools
    weight.grad = hidden.grad = None
    before = rss_mib()
    lp, ent = head_logprobs(hidden, weight, targets, chunk_size=HEAD_CHUNK)
    (lp.sum() + 0.1 * ent.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    finite = bool(torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all())
    return {"extra_peak_mib": peak - before, "finite": finite}


def _pass_peak_memory():
    """The whole forward-only log-prob pass of a tiny model on one packed 16K-token row."""
    import resource

    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.training.microbatch import next_token_sample
    from megatron_earl.training.rl_step import forward_logprobs

    model = ModelConfig(
        num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=128, num_attention_heads=4,
        vocab_size=VOCAB, make_vocab_size_divisible_by=64,
    )  # fmt: skip
    initialize_layout(ParallelLayout())
    runtime.seed(0)
    chunks = build_model(model)
    gen = torch.Generator().manual_seed(0)
    samples = [
        next_token_sample(torch.randint(0, VOCAB, (1024,), generator=gen), torch.ones(1024) > 0)
        for _ in range(SEQ // 1024)
    ]
    forward_logprobs(chunks, samples[:1], max_tokens=SEQ, chunk_size=HEAD_CHUNK)  # warm-up
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    lp, _ = forward_logprobs(chunks, samples, max_tokens=SEQ, chunk_size=HEAD_CHUNK)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"extra_peak_mib": peak - before, "tokens": sum(t.numel() for t in lp)}


def test_16k_packed_logprob_pass_peak_memory_is_bounded():
    (res,) = run_distributed(_pass_peak_memory, 1, timeout_s=240)
    assert res["tokens"] == SEQ
    assert res["extra_peak_mib"] < PASS_BOUND_MIB, res


def test_16k_head_peak_memory_is_bounded():
    (res,) = run_distributed(_head_peak_memory, 1, timeout_s=240)
    assert res["finite"]
    assert res["extra_peak_mib"] < PEAK_BOUND_MIB, res


ENTROPY_CASES = (("grad", True), ("grad", False), ("value", False), ("none", False))
"""(entropy mode, whether the loss uses the entropy)."""


def _entropy_modes():
    """The head in TP2 (the world group) in each entropy mode, on the same inputs."""
    import torch.distributed as dist

    from megatron_earl.training.logprobs import head_logprobs

    rank, vocab, rows = dist.get_rank(), 96, 48
    gen = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(40, 16, generator=gen)
    weight0 = 0.3 * torch.randn(vocab, 16, generator=gen)
    targets = torch.randint(0, 90, (40,), generator=gen)
    out = {}
    for mode, entropy_in_loss in ENTROPY_CASES:
        hidden = hidden0.clone().requires_grad_()
        weight = weight0[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        lp, ent = head_logprobs(
            hidden, weight, targets, chunk_size=7, vocab_size=90, tp_group=dist.group.WORLD,
            entropy=mode,
        )  # fmt: skip
        loss = (lp * torch.linspace(-1, 1, 40)).sum()
        if entropy_in_loss:
            loss = loss - 0.1 * ent.sum()
        loss.backward()
        out[(mode, entropy_in_loss)] = {
            "lp": lp.detach(),
            "ent": None if ent is None else ent.detach(),
            "ent_requires_grad": ent is not None and ent.requires_grad,
            "grads": (hidden.grad, weight.grad),
        }
    try:
        head_logprobs(hidden0, weight0[:rows], targets, tp_group=dist.group.WORLD, entropy="x")
    except ValueError as err:
        out["error"] = str(err)
    return out


def test_entropy_modes_same_logprobs_and_loss_gradients():
    """Modes "value" (entropy as a metric) and "none" (forward-only passes) give bitwise the
    log-probs of "grad", and the same gradients as "grad" when the loss does not use the entropy
    (the backward skips the entropy terms); "value" is detached, "none" computes nothing; a loss
    that uses the entropy still gets its gradient."""
    for res in run_distributed(_entropy_modes, 2, timeout_s=120):
        full = res[("grad", True)]
        base = res[("grad", False)]
        assert full["ent_requires_grad"] and base["ent_requires_grad"]
        for key in (("value", False), ("none", False)):
            assert torch.equal(res[key]["lp"], base["lp"]), key
            for got, want in zip(res[key]["grads"], base["grads"], strict=True):
                assert torch.equal(got, want), key
        assert torch.equal(res[("value", False)]["ent"], base["ent"])
        assert not res[("value", False)]["ent_requires_grad"]
        assert res[("none", False)]["ent"] is None
        assert not torch.equal(full["grads"][0], base["grads"][0])  # the entropy term's gradient
        assert "entropy='x'; valid: ('grad', 'value', 'none')" in res["error"]
