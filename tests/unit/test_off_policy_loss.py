"""The off-policy correction of the decoupled PPO objective (``losses.off_policy``): every
correction (none, tis, mis, icepop) at every level (token, sequence, geometric) against a direct
per-token reference written out in plain torch loops here, on packed rows; hand values; the legacy
``tis_cap``; CP halves; the metrics; bad config.

Run: python -m pytest -q tests/unit/test_off_policy_loss.py. Tolerances: 1e-6 absolute (and
relative on the loss and its gradient: fp32 sums of a few dozen terms).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_earl.training.losses import PolicyLossConfig, policy_loss

LN = math.log
CASES = [
    ("none", "token"),
    ("tis", "token"),
    ("tis", "sequence"),
    ("tis", "geometric"),
    ("mis", "token"),
    ("mis", "sequence"),
    ("mis", "geometric"),
    ("icepop", "token"),
]
BOUNDS = {"tis": (None, 1.3), "mis": (0.7, 1.3), "icepop": (0.8, 1.25), "none": (None, None)}


def close(actual, expected, atol: float = 1e-6, rtol: float = 0.0) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=rtol,
    )


def _batch(seed: int = 0):
    """Two packed rows of five samples (one empty), padding at the end, spread-out weights."""
    gen = torch.Generator().manual_seed(seed)
    seq_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, -1], [3, 3, 3, 3, 3, 4, 4, 4, -1, -1]])
    mask = (seq_ids >= 0).float()
    mask[0, 0] = mask[1, 0] = 0.0  # prompt tokens
    mask[0, 7:9] = 0.0  # sample 2: no trainable token
    old = -2.0 + 0.5 * torch.randn(2, 10, generator=gen)
    logp = old + 0.3 * torch.randn(2, 10, generator=gen)
    rollout = old + 0.35 * torch.randn(2, 10, generator=gen)
    rollout[1, :5] -= 0.4  # sample 3 stale one way (w > 1), sample 1 the other way (w < 1)
    rollout[0, 4:7] += 0.5
    adv = torch.randn(2, 10, generator=gen)
    return logp, old, rollout, adv, mask, seq_ids


def _reference(correction, level, low, high, logp, old, rollout, adv, mask, seq_ids, eps=0.2):
    """PPO-clip against pi_old, each token's term times the detached behaviour weight, token
    mean over every trainable token (masked ones included): written token by token."""
    rows, cols = mask.shape
    tokens = [(b, t) for b in range(rows) for t in range(cols) if mask[b, t] != 0]
    by_sample: dict[int, list[tuple[int, int]]] = {}
    for b, t in tokens:
        by_sample.setdefault(int(seq_ids[b, t]), []).append((b, t))

    def w_tok(b, t):
        return math.exp(float(old[b, t]) - float(rollout[b, t]))

    raw: dict[tuple[int, int], float] = {}
    for members in by_sample.values():
        logs = [math.log(w_tok(b, t)) for b, t in members]
        if level == "sequence":
            seq = math.exp(sum(logs))
        elif level == "geometric":
            seq = math.exp(sum(logs) / len(logs))
        for b, t in members:
            raw[b, t] = w_tok(b, t) if level == "token" else seq

    def weight(w):
        if correction == "none":
            return 1.0
        if correction == "tis":
            return min(w, high)
        return w if low <= w <= high else 0.0

    total = logp.new_zeros(())
    for b, t in tokens:
        ratio = torch.exp(logp[b, t] - old[b, t])
        a = float(adv[b, t])
        term = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps))
        total = total + weight(raw[b, t]) * term
    loss = total / len(tokens)
    masked = [k for k in tokens if correction in ("mis", "icepop") and weight(raw[k]) == 0.0]
    truncated = [k for k in tokens if correction == "tis" and raw[k] > high]
    metrics = {
        "is_weight_mean": sum(raw.values()) / len(tokens),
        "is_weight_max": max(raw.values()),
        "is_weight_min": min(raw.values()),
        "tis_weight_mean": sum(weight(w) for w in raw.values()) / len(tokens),
        "tis_clip_frac": len(truncated) / len(tokens),
        "is_mask_frac": len(masked) / len(tokens),
        "is_seq_clipped": 0.0,
        "is_seq_masked": 0.0,
    }
    if level != "token":
        firsts = [members[0] for members in by_sample.values()]
        metrics["is_seq_clipped"] = float(sum(k in truncated for k in firsts))
        metrics["is_seq_masked"] = float(sum(k in masked for k in firsts))
    return loss, metrics


def _config(correction, level, **kw):
    if correction == "none":
        return PolicyLossConfig(**kw)
    low, high = BOUNDS[correction]
    return PolicyLossConfig(
        off_policy_correction=correction,
        off_policy_level=level,
        is_weight_low=low,
        is_weight_high=high,
        **kw,
    )


@pytest.mark.parametrize(("correction", "level"), CASES)
def test_every_correction_matches_the_per_token_reference(correction, level):
    logp0, old, rollout, adv, mask, seq_ids = _batch()
    low, high = BOUNDS[correction]
    logp = logp0.clone().requires_grad_()
    loss, m = policy_loss(
        _config(correction, level),
        logp,
        adv,
        mask,
        old_logprobs=old,
        rollout_logprobs=rollout,
        seq_ids=seq_ids,
    )
    loss.backward()
    ref_logp = logp0.clone().requires_grad_()
    want, want_m = _reference(
        correction, level, low, high, ref_logp, old, rollout, adv, mask, seq_ids
    )
    want.backward()
    close(loss, want, rtol=1e-5)
    close(logp.grad, ref_logp.grad, rtol=1e-5)
    for key, value in want_m.items():
        close(m[key], value, atol=1e-5, rtol=1e-5)
    # the data exercise the correction: some tokens (or samples) fall on each side of a bound
    if correction == "tis":
        assert 0 < float(m["tis_clip_frac"]) < 1, m
    if correction in ("mis", "icepop"):
        assert 0 < float(m["is_mask_frac"]) < 1, m
    if correction != "none" and level != "token":
        assert float(m["is_seq_clipped"] + m["is_seq_masked"]) >= 1, m


def test_the_reference_sees_the_weight():
    # guards the reference test against a weight that never matters: on this batch each
    # correction gives a loss different from plain PPO against pi_old
    logp, old, rollout, adv, mask, seq_ids = _batch()
    plain, _ = _reference("none", "token", None, None, logp, old, rollout, adv, mask, seq_ids)
    for correction, level in CASES[1:]:
        low, high = BOUNDS[correction]
        got, _ = _reference(correction, level, low, high, logp, old, rollout, adv, mask, seq_ids)
        assert abs(float(got) - float(plain)) > 1e-3, (correction, level)


def test_decoupled_hand_values_tis_and_mis():
    # three tokens, pi / pi_old = [1.5, 1.0, 0.5], w = pi_old / pi_rollout = [3, 1, 0.25], A = 1,
    # eps 0.2: PPO terms max(-r, -clip(r)) = [-1.2, -1.0, -0.5] (clipped high on token 0).
    # tis (C = 2): weights [2, 1, 0.25] -> loss = (-2.4 - 1.0 - 0.125) / 3 = -1.175;
    #   gradient only through unclipped tokens: dL/dlogp = -w r / 3 = [0, -1/3, -0.125/3].
    # mis [0.5, 2]: weights [0, 1, 0] -> loss = -1.0 / 3 (masked tokens still in N = 3).
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    logp0 = old + torch.tensor([[LN(1.5), 0.0, LN(0.5)]])
    rollout = old - torch.tensor([[LN(3.0), 0.0, LN(0.25)]])
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    tis = PolicyLossConfig(off_policy_correction="tis", is_weight_high=2.0)
    logp = logp0.clone().requires_grad_()
    loss, m = policy_loss(tis, logp, adv, mask, old_logprobs=old, rollout_logprobs=rollout)
    close(loss, -1.175)
    loss.backward()
    close(logp.grad, [[0.0, -1 / 3, -0.125 / 3]])
    close(m["tis_clip_frac"], 1 / 3)
    close(m["tis_weight_mean"], (2 + 1 + 0.25) / 3)
    close(m["is_weight_max"], 3.0)
    close(m["is_weight_min"], 0.25)
    close(m["is_weight_mean"], (3 + 1 + 0.25) / 3)
    mis = PolicyLossConfig(off_policy_correction="mis", is_weight_low=0.5, is_weight_high=2.0)
    logp = logp0.clone().requires_grad_()
    loss, m = policy_loss(mis, logp, adv, mask, old_logprobs=old, rollout_logprobs=rollout)
    close(loss, -1.0 / 3)
    loss.backward()
    close(logp.grad, [[0.0, -1 / 3, 0.0]])
    close(m["is_mask_frac"], 2 / 3)
    close(m["tis_clip_frac"], 0.0)
    # sequence level: W = 3 * 1 * 0.25 = 0.75, inside [0.5, 2]: every token weighted 0.75
    seq = PolicyLossConfig(
        off_policy_correction="mis",
        off_policy_level="sequence",
        is_weight_low=0.5,
        is_weight_high=2.0,
    )
    loss, m = policy_loss(seq, logp0, adv, mask, old_logprobs=old, rollout_logprobs=rollout)
    close(loss, 0.75 * (-1.2 - 1.0 - 0.5) / 3)
    close(m["is_seq_masked"], 0.0)
    close(m["is_weight_max"], 0.75)


def test_legacy_tis_cap_is_token_tis_bit_for_bit():
    logp0, old, rollout, adv, mask, seq_ids = _batch(1)
    legacy = PolicyLossConfig(tis_cap=1.3)
    assert (legacy.off_policy_correction, legacy.is_weight_high) == ("tis", 1.3)
    new = PolicyLossConfig(off_policy_correction="tis", is_weight_high=1.3)
    out = []
    for cfg in (legacy, new):
        logp = logp0.clone().requires_grad_()
        loss, m = policy_loss(
            cfg, logp, adv, mask, old_logprobs=old, rollout_logprobs=rollout, seq_ids=seq_ids
        )
        loss.backward()
        out.append((loss, logp.grad, m))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert all(torch.equal(out[0][2][k], out[1][2][k]) for k in out[0][2])


def test_icepop_is_two_sided_token_mis_with_its_bounds():
    logp, old, rollout, adv, mask, seq_ids = _batch(2)
    icepop = PolicyLossConfig(off_policy_correction="icepop")
    assert (icepop.is_weight_low, icepop.is_weight_high) == (0.5, 5.0)
    mis = PolicyLossConfig(off_policy_correction="mis", is_weight_low=0.5, is_weight_high=5.0)
    kw = dict(old_logprobs=old, rollout_logprobs=rollout * 3.0, seq_ids=seq_ids)  # wide w
    a, ma = policy_loss(icepop, logp, adv, mask, **kw)
    b, mb = policy_loss(mis, logp, adv, mask, **kw)
    assert torch.equal(a, b) and 0 < float(ma["is_mask_frac"]) < 1
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_none_applies_no_weight_but_reports_it():
    logp, old, rollout, adv, mask, _ = _batch(3)
    cfg = PolicyLossConfig()
    with_w, m = policy_loss(cfg, logp, adv, mask, old_logprobs=old, rollout_logprobs=rollout)
    without, m0 = policy_loss(cfg, logp, adv, mask, old_logprobs=old)
    assert torch.equal(with_w, without)
    assert float(m["is_weight_max"]) > 1 > float(m["is_weight_min"])  # the staleness shows
    close(m["tis_weight_mean"], 1.0)
    close(m0["is_weight_mean"], 1.0)
    close(m0["is_weight_max"], 1.0)


@pytest.mark.parametrize(("correction", "level"), [c for c in CASES if c[1] != "token"])
def test_cp_halves_add_up_to_the_whole(correction, level):
    # each CP rank holds half of every sample's tokens; seq_sum_reduce adds the other half's
    # partial sums, so the sequence weights, the loss and the sample counts add up to the whole
    logp, old, rollout, adv, mask, seq_ids = _batch(4)
    cfg = _config(correction, level)
    kw = dict(old_logprobs=old, rollout_logprobs=rollout, normaliser=float((mask != 0).sum()))
    full, full_m = policy_loss(cfg, logp, adv, mask, seq_ids=seq_ids, **kw)
    halves = (slice(0, 5), slice(5, 10))

    def part(cols, reduce):
        return policy_loss(
            cfg,
            logp[:, cols],
            adv[:, cols],
            mask[:, cols],
            seq_ids=seq_ids[:, cols],
            seq_sum_reduce=reduce,
            **{k: v[:, cols] if torch.is_tensor(v) else v for k, v in kw.items()},
        )

    sent = {}  # first pass: what each half would send
    for i, cols in enumerate(halves):
        part(cols, lambda x, i=i: sent.setdefault(i, x))

    def padded(x, n):  # a half names only the samples up to its largest id
        return torch.cat([x, x.new_zeros(n - len(x), x.shape[1])])

    total, seq_masked, seq_clipped = 0.0, 0.0, 0.0
    for i, cols in enumerate(halves):
        other = sent[1 - i]
        loss, m = part(cols, lambda x, o=other: x + padded(o, max(len(x), len(o)))[: len(x)])
        total = total + loss
        seq_masked += float(m["is_seq_masked"])
        seq_clipped += float(m["is_seq_clipped"])
    close(total, full, rtol=1e-5)
    close(seq_masked, full_m["is_seq_masked"], atol=1e-5)
    close(seq_clipped, full_m["is_seq_clipped"], atol=1e-5)


def test_missing_rollout_logprobs_raises():
    cfg = PolicyLossConfig(off_policy_correction="mis")
    with pytest.raises(ValueError, match="off_policy_correction='mis' needs rollout_logprobs"):
        policy_loss(cfg, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"off_policy_correction": "is"}, "off_policy_correction='is'; valid"),
        ({"off_policy_correction": "tis", "off_policy_level": "seq"}, "off_policy_level='seq'"),
        ({"is_weight_high": 2.0}, "off_policy_correction='none' applies no weight"),
        ({"off_policy_level": "sequence"}, "off_policy_level='sequence'"),
        ({"off_policy_correction": "tis", "is_weight_low": 0.5}, "is_weight_low=0.5 with"),
        ({"off_policy_correction": "tis", "is_weight_high": 0.0}, "is_weight_high=0.0; valid"),
        ({"off_policy_correction": "mis", "is_weight_high": float("inf")}, "is_weight_high=inf"),
        ({"off_policy_correction": "mis", "is_weight_low": 3.0}, r"is_weight_low=3.0; valid"),
        ({"off_policy_correction": "mis", "is_weight_low": -0.1}, r"is_weight_low=-0.1; valid"),
        (
            {"off_policy_correction": "icepop", "off_policy_level": "geometric"},
            "with off_policy_correction='icepop'",
        ),
        ({"tis_cap": 2.0, "off_policy_correction": "mis"}, "tis_cap=2.0 is the legacy"),
        ({"tis_cap": 2.0, "is_weight_high": 3.0}, "tis_cap=2.0 and is_weight_high=3.0"),
    ],
)
def test_bad_off_policy_config_names_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


def test_resolved_defaults_round_trip():
    import dataclasses

    for correction, (low, high) in (("tis", (None, 2.0)), ("mis", (0.0, 2.0))):
        cfg = PolicyLossConfig(off_policy_correction=correction)
        assert (cfg.is_weight_low, cfg.is_weight_high) == (low, high)
        assert dataclasses.replace(cfg, check_finite=False) == dataclasses.replace(
            cfg, check_finite=False
        )
    legacy = PolicyLossConfig(tis_cap=1.5)
    assert dataclasses.replace(legacy, check_finite=False).is_weight_high == 1.5
