"""Which layer implementation a model is built with (``models.impl.resolve_transformer_impl``), the
start-up errors for Transformer Engine and TE-only options on a machine without TE or CUDA, and the
extras of setup.py (none installs PyPI's unrelated ``apex``). Transformer Engine is not installable
here: the machine's facts are arguments of the pure functions, or faked through the probe
(``compat.optional`` via ``models.impl.has_transformer_engine``) and ``runtime.policy``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron_earl import runtime
from megatron_earl.config.loader import load_config
from megatron_earl.config.model import ModelConfig, ModelConfigError
from megatron_earl.config.run import ConfigError
from megatron_earl.config.vocab import TransformerImpl
from megatron_earl.models import gpt, impl
from megatron_earl.models.impl import (
    machine_transformer_impl,
    pin_transformer_impl,
    resolve_transformer_impl,
    transformer_impl_problems,
)

ROOT = Path(__file__).resolve().parents[2]
TE, LOCAL = TransformerImpl.TRANSFORMER_ENGINE, TransformerImpl.LOCAL


@pytest.mark.parametrize(
    "requested,te_importable,cuda,embedded,expected",
    [
        ("auto", True, True, False, TE),
        ("auto", True, True, True, LOCAL),  # the embedded engine's slot cache needs a mask
        ("auto", True, False, False, LOCAL),  # TE installed, no CUDA (or the emulated device)
        ("auto", False, True, False, LOCAL),
        ("auto", False, False, False, LOCAL),
        ("local", True, True, False, LOCAL),
        ("local", False, False, True, LOCAL),
        ("transformer_engine", True, True, False, TE),
        ("transformer_engine", False, False, True, TE),  # as asked: the checks refuse it
    ],
)
def test_resolution_table(requested, te_importable, cuda, embedded, expected):
    got = resolve_transformer_impl(
        requested, te_importable=te_importable, cuda=cuda, embedded_engine=embedded
    )
    assert got is expected


def _problems(model: ModelConfig, *, te=True, cuda=True, embedded=False) -> list[str]:
    return transformer_impl_problems(model, te_importable=te, cuda=cuda, embedded_engine=embedded)


def test_transformer_engine_requested_without_the_package_names_option_and_package():
    (msg,) = _problems(ModelConfig(transformer_impl="transformer_engine"), te=False)
    assert "model.transformer_impl='transformer_engine'" in msg
    assert "transformer_engine package" in msg and 'pip install -e ".[te]"' in msg


def test_transformer_engine_refused_without_cuda_and_with_the_embedded_engine():
    model = ModelConfig(transformer_impl="transformer_engine")
    no_cuda, embedded = _problems(model, cuda=False, embedded=True)
    assert "needs a CUDA device" in no_cuda and "model.transformer_impl" in no_cuda
    assert "rollout.engine=embedded" in embedded
    assert len(_problems(model, te=False, cuda=False, embedded=True)) == 3
    assert _problems(model) == []


@pytest.mark.parametrize("te,cuda,embedded", [(False, True, False), (True, False, False)])
def test_cp_comm_type_is_a_te_only_option(te, cuda, embedded):
    (msg,) = _problems(ModelConfig(cp_comm_type="a2a"), te=te, cuda=cuda, embedded=embedded)
    assert "model.cp_comm_type='a2a' is a Transformer Engine option" in msg
    assert f"transformer_engine importable: {te}, CUDA: {cuda}" in msg
    assert 'pip install -e ".[te]"' in msg
    assert _problems(ModelConfig(cp_comm_type="a2a")) == []
    assert _problems(ModelConfig(), te=te, cuda=cuda, embedded=embedded) == []


def test_cp_comm_type_with_the_embedded_engine_and_auto_is_refused():
    (msg,) = _problems(ModelConfig(cp_comm_type="p2p"), embedded=True)
    assert "embedded engine: True" in msg and "rollout.engine=sglang" in msg


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"transformer_impl": "te"}, "transformer_impl: unknown TransformerImpl 'te'; valid: auto"),
        ({"attention_backend": "te"}, "chosen by model.transformer_impl"),
        ({"cp_comm_type": "ring"}, "cp_comm_type 'ring' is not one of None, 'p2p', 'all_gather'"),
    ],
)
def test_bad_values_name_the_value_and_the_choices(kwargs, fragment):
    with pytest.raises(ModelConfigError) as err:
        ModelConfig(**kwargs)
    assert fragment in str(err.value)


def test_transformer_impl_is_a_vocabulary_member():
    assert ModelConfig(transformer_impl="local").transformer_impl is LOCAL
    assert ModelConfig().transformer_impl is TransformerImpl.AUTO


def _fake_machine(monkeypatch, *, te: bool, cuda: bool) -> None:
    """The probe and the device policy as on a machine with/without TE and CUDA."""
    monkeypatch.setattr(impl, "has_transformer_engine", lambda: te)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    policy = runtime.DevicePolicy(device, "nccl" if cuda else "gloo")
    monkeypatch.setattr(runtime, "policy", lambda: policy)


def test_this_machine_builds_local():
    assert machine_transformer_impl(ModelConfig()) is LOCAL  # no TE here


def test_machine_facts_come_from_the_probe_and_the_device_policy(monkeypatch):
    _fake_machine(monkeypatch, te=True, cuda=True)
    assert machine_transformer_impl(ModelConfig()) is TE
    assert pin_transformer_impl(ModelConfig(), embedded_engine=True).transformer_impl is LOCAL
    assert pin_transformer_impl(ModelConfig(), embedded_engine=False).transformer_impl is TE
    _fake_machine(monkeypatch, te=True, cuda=False)
    assert machine_transformer_impl(ModelConfig()) is LOCAL


def test_layer_spec_is_megatrons_te_spec_when_te_resolves(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_earl.models.attention import SDPAttention

    calls = []
    monkeypatch.setattr(
        gpt_layer_specs,
        "get_gpt_layer_with_transformer_engine_spec",
        lambda **kw: calls.append(kw) or "te-spec",
    )
    _fake_machine(monkeypatch, te=True, cuda=True)
    assert gpt.layer_spec(ModelConfig(qk_layernorm=True), cp=2) == "te-spec"
    assert calls == [{"qk_layernorm": True}]
    _fake_machine(monkeypatch, te=False, cuda=True)
    spec = gpt.layer_spec(ModelConfig())
    assert spec.submodules.self_attention.submodules.core_attention is SDPAttention
    with pytest.raises(ModelConfigError, match=r'pip install -e "\.\[te\]"'):
        gpt.layer_spec(ModelConfig(transformer_impl="transformer_engine"))


def test_start_up_check_refuses_transformer_engine_here():
    from megatron_earl.cli.train import check_run

    cfg = load_config(ROOT / "configs/demo_cpu.yaml", ["model.transformer_impl=transformer_engine"])
    with pytest.raises(ConfigError) as err:
        check_run(cfg, world_size=2)
    msg = str(err.value)
    assert "model.transformer_impl='transformer_engine'" in msg
    assert 'pip install -e ".[te]"' in msg and "needs a CUDA device" in msg
    check_run(load_config(ROOT / "configs/demo_cpu.yaml"), world_size=2)


def _extras() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def test_no_extra_installs_the_unrelated_pypi_apex():
    import re

    extras = _extras()
    assert "te" in extras and "apex" not in extras
    names = {
        re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower() for r in extras.values() for req in r
    }
    assert "apex" not in names, names
