"""The version guard (the CPU patches are tested in test_patches.py)."""

from __future__ import annotations

import pytest

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
