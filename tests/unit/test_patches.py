"""The patches under the top-level ``patches/``: every module has its header and is tied to the
version guard, a target missing from the installed megatron-core fails clearly, the CPU patches
are scoped, and no module under ``megatron_earl/`` assigns to a Megatron-Core attribute."""

from __future__ import annotations

import ast
import importlib
import re
import runpy
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

from megatron_earl import patches
from megatron_earl.compat.version import SUPPORTED_MCORE
from megatron_earl.patches import PatchTargetError, Target, check_targets, cpu_redirect

ROOT = Path(__file__).resolve().parents[2]
PATCH_FILES = sorted(p for p in (ROOT / "patches").glob("*.py") if p.name != "__init__.py")
HEADER_FIELDS = ("What:", "Why:", "Versions:", "Test:")


def _module(path: Path):
    return importlib.import_module(f"megatron_earl.patches.{path.stem}")


def test_patches_package_is_the_top_level_directory():
    assert Path(patches.__file__).resolve() == ROOT / "patches" / "__init__.py"
    assert [p.stem for p in PATCH_FILES] == sorted(patches.PATCHES)


def test_setup_installs_patches_as_megatron_earl_patches(monkeypatch):
    import setuptools

    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"))
    assert captured["package_dir"] == {"megatron_earl.patches": "patches"}
    assert "megatron_earl.patches" in captured["packages"]
    assert "megatron_earl" in captured["packages"]


@pytest.mark.parametrize("path", PATCH_FILES, ids=lambda p: p.stem)
def test_every_patch_opens_with_its_header(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, f"{path.name} has no module docstring"
    missing = [f for f in HEADER_FIELDS if not re.search(rf"^{f}", doc, flags=re.M)]
    assert not missing, f"{path.name}: header lacks {missing}"
    module = _module(path)
    versions = re.search(r"^Versions:(.*)$", doc, flags=re.M).group(1)
    assert f"megatron-core{module.VERSIONS}" in versions, (path.name, versions)
    test_section = doc[doc.index("Test:") :]
    test_files = re.findall(r"tests/[\w/]+\.py", test_section)
    assert test_files, f"{path.name}: 'Test:' names no test file"
    for test_file in test_files:
        assert (ROOT / test_file).is_file(), f"{path.name} names a missing test {test_file}"
    sources = "".join((ROOT / f).read_text() for f in test_files)
    for name in re.findall(r"\btest_\w+", re.sub(r"tests/[\w/]+\.py", "", test_section)):
        assert f"def {name}(" in sources, f"{path.name} names a missing test {name}"


@pytest.mark.parametrize("path", PATCH_FILES, ids=lambda p: p.stem)
def test_patch_versions_follow_the_version_guard(path):
    module = _module(path)
    assert SpecifierSet(module.VERSIONS) == SpecifierSet(SUPPORTED_MCORE), (
        f"{path.name} is written for megatron-core{module.VERSIONS} but the guard allows "
        f"{SUPPORTED_MCORE}: re-check the patch against the new range and update both"
    )
    assert module.TARGETS and all(isinstance(t, Target) for t in module.TARGETS)
    assert all(t.exists() for t in module.TARGETS), [str(t) for t in module.TARGETS]


@pytest.mark.parametrize(
    "target",
    [
        Target("megatron.core.parallel_state", "no_such_attribute"),
        Target("megatron.core.utils", "GlobalMemoryBuffer.no_such_method"),
        Target("megatron.core.no_such_module", "anything"),
    ],
    ids=str,
)
def test_missing_target_names_the_patch_and_the_version(target):
    assert not target.exists()
    with pytest.raises(PatchTargetError) as err:
        check_targets("megatron_earl.patches.demo", ">=0.16.0,<0.17.0", [target])
    message = str(err.value)
    assert "'megatron_earl.patches.demo'" in message and "patches/demo.py" in message
    assert f"megatron-core {metadata.version('megatron-core')}" in message
    assert str(target) in message and ">=0.16.0,<0.17.0" in message


@pytest.mark.parametrize("name", ["output_layer_passthrough", "cpu_rng_tracker"])
def test_apply_all_refuses_a_patch_whose_target_is_gone(monkeypatch, name):
    module = importlib.import_module(f"megatron_earl.patches.{name}")
    gone = Target("megatron.core.tensor_parallel.layers", "RemovedInANewerRelease")
    monkeypatch.setattr(module, "TARGETS", (*module.TARGETS, gone))
    with pytest.raises(PatchTargetError, match=rf"patch '{module.__name__}'.*RemovedInANewer"):
        patches.apply_all()


def test_apply_is_idempotent():
    assert patches.apply_all() == patches.apply_all()
    assert cpu_redirect.apply() == cpu_redirect.apply()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_redirect_is_scoped_to_wrapped_functions():
    cpu_redirect.apply()
    with cpu_redirect.cuda_to_cpu():
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_schedule_steps_run_without_the_redirect():
    """A redirected schedule's forward_step / backward_step run with no torch-function mode (no
    Python hook on every op of the model); a redirected function called inside opens its own
    scope; the schedule's own code is redirected again after each."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import GlobalMemoryBuffer

    cpu_redirect.apply()
    assert getattr(schedules.forward_step, "__megatron_earl_redirected__", False)
    assert getattr(schedules.backward_step, "__megatron_earl_redirected__", False)
    seen = []

    def probe():
        seen.append(torch._C._is_torch_function_mode_enabled())
        assert torch.cuda.current_device() == "cpu"  # the stand-in stays for the layers
        buf = GlobalMemoryBuffer().get_tensor((2,), torch.float32, "y")  # redirected inside
        made = cpu_redirect._redirected(lambda: torch.zeros(1, device="cuda"))()  # a new scope
        seen.append((buf.device.type, made.device.type, torch._C._is_torch_function_mode_enabled()))

    exempt = cpu_redirect._exempted(lambda: probe())
    with cpu_redirect.cuda_to_cpu():
        exempt()
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert seen == [False, ("cpu", "cpu", False)]
    plain = cpu_redirect._exempted(lambda: seen.append(torch._C._is_torch_function_mode_enabled()))
    plain()  # outside any redirect: a plain call
    assert seen[2] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_warning_filter_hides_only_the_cuda_connections_advice():
    from megatron_earl.patches import quiet_warnings

    advice = (
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
    )
    megatron_layers = "megatron.core.tensor_parallel.layers"
    assert quiet_warnings.apply()
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit(advice, UserWarning, "layers.py", 738, module=megatron_layers)
        warnings.warn_explicit(advice, UserWarning, "other.py", 1, module="other.module")
        warnings.warn_explicit("other advice", UserWarning, "layers.py", 9, module=megatron_layers)
    assert [(str(w.message), w.filename) for w in caught] == [
        (advice, "other.py"),
        ("other advice", "layers.py"),
    ]


def test_megatron_core_import_leaves_dynamo_unloaded():
    # A fresh process: megatron_earl first (as every entry point), then what the trainer and the
    # embedded engine import from megatron-core.
    code = (
        "import sys, megatron_earl\n"
        "import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.transformer\n"
        "from megatron.core import jit\n"
        "from megatron_earl.patches import lazy_jit_fuser\n"
        "print(jit.jit_fuser is lazy_jit_fuser.lazy_compile, lazy_jit_fuser.apply(),\n"
        "      sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "True True []", done.stdout


def test_lazy_compile_compiles_at_the_first_call(monkeypatch):
    from megatron_earl.patches.lazy_jit_fuser import lazy_compile

    made = []

    def fake_compile(fn, **kwargs):
        made.append((fn.__name__, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)

    def add(a, b=0):
        return a + b

    plain, with_args = lazy_compile(add), lazy_compile(dynamic=True)(add)
    assert made == [] and plain.__name__ == "add"
    assert plain(1, b=2) == ("compiled", 3) and plain(2) == ("compiled", 2)
    assert with_args(3) == ("compiled", 3)
    assert made == [("add", {}), ("add", {"dynamic": True})]


# ----------------------------------------------------------------------------- no patch elsewhere


def megatron_assignments(source: str) -> list[str]:
    """Assignments to Megatron-Core attributes in ``source``: an assignment, ``del``, ``setattr``
    or ``delattr`` whose target is reached through a name bound by an import from ``megatron``,
    and any instance method swap (``x.forward = ...``)."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(
                a.asname or "megatron" for a in node.names if a.name.split(".")[0] == "megatron"
            )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron":
            names.update(a.asname or a.name for a in node.names)

    def root(expr: ast.expr) -> str | None:
        while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
            expr = expr.func if isinstance(expr, ast.Call) else expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    def flatten(targets: list[ast.expr]) -> list[ast.expr]:
        out = []
        for t in targets:
            out.extend(flatten(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out

    hits = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and root(node.args[0]) in names
        ):
            hits.append(f"line {node.lineno}: {ast.unparse(node)}")
            continue
        else:
            continue
        for target in flatten(targets):
            if isinstance(target, ast.Attribute) and (
                root(target) in names or target.attr == "forward"
            ):
                hits.append(f"line {node.lineno}: {ast.unparse(target)}")
    return hits


@pytest.mark.parametrize(
    "source",
    [
        "from megatron.core import parallel_state\nparallel_state.create_group = f",
        "from megatron.core import parallel_state\nsetattr(parallel_state, name, None)",
        "from megatron.core.dist_checkpointing.strategies import filesystem_async as fa\n"
        "fa._results_queue = q",
        "import megatron.core.parallel_state as ps\nps._GLOBAL_MEMORY_BUFFER, x = b, 1",
        "import megatron.core\nmegatron.core.tensor_parallel.random._get_cuda_rng_state = g",
        "from megatron.core.utils import GlobalMemoryBuffer\nGlobalMemoryBuffer.get_tensor = g",
        "def f(layer):\n    layer.forward = g",
        "def f(layer):\n    del layer.forward",
    ],
)
def test_scan_finds_megatron_assignments(source):
    assert megatron_assignments(source)


@pytest.mark.parametrize(
    "source",
    [
        "from megatron.core import parallel_state\nx = parallel_state.get_data_parallel_rank()",
        "cfg.lr = 1.0\nself.module = m",
        "from megatron.core.transformer import TransformerConfig\nconfig = TransformerConfig(x=1)",
    ],
)
def test_scan_ignores_other_assignments(source):
    assert not megatron_assignments(source)


def test_no_module_outside_patches_assigns_to_megatron_core():
    found = {
        str(path.relative_to(ROOT)): hits
        for path in sorted((ROOT / "megatron_earl").rglob("*.py"))
        if (hits := megatron_assignments(path.read_text()))
    }
    assert not found, f"Megatron-Core patched outside patches/ (move it into a patch): {found}"
