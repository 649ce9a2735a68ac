"""The version guard and the scope of the CUDA -> CPU redirect."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.compat import cpu as cpu_compat
from megatron_earl.compat.version import (
    SUPPORTED_MCORE,
    UnsupportedVersionError,
    check_megatron_core,
    check_version,
)


def test_installed_megatron_core_is_supported():
    assert check_megatron_core().startswith("0.16.")


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "1.0.0"])
def test_untested_versions_fail_clearly(version):
    with pytest.raises(UnsupportedVersionError) as err:
        check_version(version)
    assert version in str(err.value) and SUPPORTED_MCORE in str(err.value)


def test_untested_version_can_be_allowed_explicitly(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda name: "0.99.0")
    with pytest.raises(UnsupportedVersionError):
        check_megatron_core()
    monkeypatch.setenv("MEGATRON_EARL_ALLOW_UNTESTED_MCORE", "1")
    assert check_megatron_core() == "0.99.0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_redirect_is_scoped_to_wrapped_functions():
    cpu_compat.apply()
    with cpu_compat.cuda_to_cpu():
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert t.cuda() is t
        assert torch.cuda.current_device() == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
    # Outside the scope nothing is redirected.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    from megatron.core.utils import GlobalMemoryBuffer

    buf = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
    assert buf.device.type == "cpu"


def test_apply_is_idempotent():
    assert cpu_compat.apply() == cpu_compat.apply()
