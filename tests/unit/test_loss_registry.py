"""The policy-loss registry: the registered names, a loss added in one class, dual_clip as a
registered entry equal to PPO with the dual-clip bound, and an unknown name failing at start-up
(config load) with the registered names listed.

Run: python -m pytest -q tests/unit/test_loss_registry.py (pure, no processes).
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from megatron_earl.config import ConfigError, load_config
from megatron_earl.orchestration.validate import validate_run
from megatron_earl.training.losses import (
    PolicyLoss,
    PolicyLossConfig,
    Surrogate,
    SurrogateInputs,
    available_losses,
    build_loss,
    policy_loss,
    register_loss,
)
from megatron_earl.training.losses import registry as registry_module
from megatron_earl.training.losses.dual_clip import DEFAULT_DUAL_CLIP_C


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logp = (-1.0 + 0.8 * torch.randn(3, 6, generator=gen)).requires_grad_(True)
    old = logp.detach() + 0.9 * torch.randn(3, 6, generator=gen)
    adv = torch.randn(3, 1, generator=gen).expand(3, 6).clone()
    mask = (torch.rand(3, 6, generator=gen) > 0.3).float()
    return logp, adv, mask, old


def test_registered_names():
    assert available_losses() == ("dual_clip", "gspo", "ppo")
    for name in available_losses():
        assert build_loss(PolicyLossConfig(loss_type=name)).name == name


def test_dual_clip_entry_equals_ppo_with_the_bound():
    logp, adv, mask, old = _inputs()
    for c, expected_c in ((None, DEFAULT_DUAL_CLIP_C), (1.5, 1.5)):
        got = policy_loss(
            PolicyLossConfig(loss_type="dual_clip", dual_clip_c=c),
            logp,
            adv,
            mask,
            old_logprobs=old,
        )
        want = policy_loss(
            PolicyLossConfig(dual_clip_c=expected_c), logp, adv, mask, old_logprobs=old
        )
        assert torch.equal(got[0], want[0])
        assert got[1]["dual_clip_frac"] > 0
        for key in want[1]:
            assert torch.equal(got[1][key], want[1][key]), key


def test_a_new_loss_is_one_registered_class(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    @register_loss
    class Vanilla(PolicyLoss):  # REINFORCE with importance ratio, unclipped
        name: ClassVar[str] = "vanilla_pg"

        def surrogate(self, inputs: SurrogateInputs) -> Surrogate:
            ratio = torch.exp(inputs.log_ratio)
            return Surrogate(-inputs.advantages * ratio, ratio)

    assert "vanilla_pg" in available_losses()
    logp, adv, mask, _ = _inputs()
    loss, metrics = policy_loss(PolicyLossConfig(loss_type="vanilla_pg"), logp, adv, mask)
    expected = (-adv * mask).sum() / mask.sum()  # on-policy: ratio 1
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    assert float(metrics["ratio_mean"]) == 1.0
    loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    with pytest.raises(ValueError, match="already registered"):

        @register_loss
        class Clash(Vanilla):
            name: ClassVar[str] = "ppo"


def test_unknown_loss_fails_at_start_up_listing_the_names():
    with pytest.raises(ConfigError) as err:
        validate_run(load_config(overrides=["train.loss.loss_type=ppo_typo"]), world_size=2)
    message = str(err.value)
    assert "ppo_typo" in message
    for name in ("dual_clip", "gspo", "ppo"):
        assert repr(name) in message
    config = PolicyLossConfig(loss_type="nope")  # built without the start-up check
    with pytest.raises(
        ValueError, match=r"loss_type='nope'; valid: \('dual_clip', 'gspo', 'ppo'\)"
    ):
        build_loss(config)
