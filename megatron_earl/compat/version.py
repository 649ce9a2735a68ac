"""Version guard: megatron-earl patches internals of specific megatron-core releases."""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

SUPPORTED_MCORE = ">=0.16.0,<0.17.0"
"""megatron-core releases this plugin was tested with. Every patch under ``patches/`` declares the
same range as its ``VERSIONS`` (``tests/unit/test_patches.py``): widening the guard means
re-checking every patch."""

ALLOW_UNTESTED_ENV = "MEGATRON_EARL_ALLOW_UNTESTED_MCORE"


class UnsupportedVersionError(RuntimeError):
    """Raised when an installed dependency is outside the tested range."""


def check_version(
    installed: str, spec: str = SUPPORTED_MCORE, package: str = "megatron-core"
) -> None:
    """Raise ``UnsupportedVersionError`` unless ``installed`` satisfies ``spec``."""
    from packaging.specifiers import SpecifierSet

    if Version(installed) not in SpecifierSet(spec):
        raise UnsupportedVersionError(
            f"{package} {installed} is not supported by megatron-earl (tested: {package}{spec}); "
            f"install a tested release, e.g. pip install '{package}{spec}', or set "
            f"{ALLOW_UNTESTED_ENV}=1 to try it anyway"
        )


def check_megatron_core() -> str:
    """Check the installed megatron-core against ``SUPPORTED_MCORE``; return its version."""
    import os

    try:
        installed = metadata.version("megatron-core")
    except metadata.PackageNotFoundError as err:
        raise UnsupportedVersionError(
            f"megatron-core is not installed; install megatron-core{SUPPORTED_MCORE}"
        ) from err
    if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        check_version(installed)
    return installed
