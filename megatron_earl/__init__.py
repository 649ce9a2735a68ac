"""megatron-earl: a Megatron-Core plugin for long-context agentic RL (EARL design)."""

import importlib.util as _importlib_util
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"


def _load_patches() -> None:
    """Make ``megatron_earl.patches`` the repository's top-level ``patches/`` directory.

    An installed wheel holds it at ``megatron_earl/patches/`` (setup.py's ``package_dir``), where
    the normal import finds it. A source checkout, or an editable install (which runs this package
    from the checkout), holds it beside this package: load it from there, so running from the
    repository root uses that checkout's patches.
    """
    here = _Path(__file__).resolve().parent
    if (here / "patches").is_dir():
        return
    source = here.parent / "patches"
    if not (source / "__init__.py").is_file():
        raise ImportError(
            f"megatron_earl.patches not found: neither {here / 'patches'} (installed) nor "
            f"{source} (source checkout) exists; reinstall megatron-earl"
        )
    spec = _importlib_util.spec_from_file_location(
        f"{__name__}.patches", source / "__init__.py", submodule_search_locations=[str(source)]
    )
    module = _importlib_util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["patches"] = module


_load_patches()

from megatron_earl.patches import lazy_jit_fuser as _lazy_jit_fuser  # noqa: E402
from megatron_earl.patches import quiet_warnings as _quiet_warnings  # noqa: E402

# megatron-core announces, at import, every torch fallback it takes when Transformer Engine / Apex
# are absent (always the case on CPU machines): hide exactly those (patches/quiet_warnings.py).
_quiet_warnings.filter_import_warnings()
# ... and decorates its fusion functions with torch.compile, which imports torch._dynamo and
# inductor (~1.3 s a process) for functions this project never runs: compile them at their first
# call instead (patches/lazy_jit_fuser.py).
_lazy_jit_fuser.install_import_hook()
