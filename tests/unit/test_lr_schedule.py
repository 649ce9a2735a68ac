"""The learning-rate schedule (``training.setup.build_lr_scheduler``: Megatron-Core's
``OptimizerParamScheduler`` driven by ``OptimConfig``) against closed forms, and its errors."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_earl.config.optim import OptimConfig
from megatron_earl.training.setup import build_lr_scheduler, set_lr_step


def _rates(optim: OptimConfig, total: int) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=optim.lr)
    scheduler = build_lr_scheduler(optimizer, optim, total)
    out = []
    for step in range(total + 2):
        set_lr_step(scheduler, step)
        out.append(optimizer.param_groups[0]["lr"])
    return out


def test_constant_after_linear_warmup():
    rates = _rates(OptimConfig(lr=1e-3, lr_warmup_steps=4, lr_warmup_init=1e-4), total=10)
    assert rates[0] == pytest.approx(1e-4)
    assert rates[2] == pytest.approx(1e-4 + (1e-3 - 1e-4) * 2 / 4)
    assert rates[4:] == pytest.approx([1e-3] * (len(rates) - 4))


def test_cosine_decay_to_min_lr_over_the_run():
    optim = OptimConfig(lr=1e-3, min_lr=1e-5, lr_decay_style="cosine", lr_warmup_steps=2)
    rates = _rates(optim, total=12)
    for step in range(2, 13):
        ratio = (step - 2) / 10
        want = 1e-5 + (1e-3 - 1e-5) * 0.5 * (math.cos(math.pi * ratio) + 1)
        assert rates[step] == pytest.approx(want), step
    assert rates[13] == pytest.approx(1e-5)  # past the decay: the floor


def test_linear_decay_with_warmup_fraction_and_explicit_decay_steps():
    optim = OptimConfig(lr=1.0, lr_decay_style="linear", lr_warmup_fraction=0.25, lr_decay_steps=8)
    rates = _rates(optim, total=100)
    assert rates[1] == pytest.approx(0.5)  # warm-up of 2 steps from 0
    assert rates[2] == pytest.approx(1.0) and rates[5] == pytest.approx(0.5)
    assert rates[8] == pytest.approx(0.0)


def test_wsd_holds_then_decays():
    optim = OptimConfig(
        lr=1.0, lr_decay_style="WSD", lr_wsd_decay_steps=4, lr_wsd_decay_style="linear"
    )
    rates = _rates(optim, total=10)
    assert rates[:7] == pytest.approx([1.0] * 7)
    assert rates[8] == pytest.approx(0.5) and rates[10] == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "muon"}, "optimizer 'muon' is not one of"),
        ({"lr_decay_style": "step"}, "lr_decay_style 'step' is not one of"),
        ({"lr_decay_style": "WSD"}, "WSD needs lr_wsd_decay_steps"),
        ({"lr_warmup_steps": 3, "lr_warmup_fraction": 0.1}, "both set"),
        ({"min_lr": 2.0, "lr": 1.0}, r"min_lr \(2.0\)"),
    ],
)
def test_bad_schedule_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


def test_warmup_longer_than_decay_is_named():
    param = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="warm-up \\(10 optimizer steps\\)"):
        build_lr_scheduler(torch.optim.SGD([param], lr=1.0), OptimConfig(lr_warmup_steps=10), 5)
