"""The GPU installs resolve: this project's `[sglang]`, `[te]` and `[sglang,te]` extras, and each
GPU install command of docs/install.md, against PyPI, for CPython 3.11 on x86-64 Linux.

What it proves, with PyPI's published metadata of today:
- the pinned SGLang (`SGLANG_PINNED`) and the CUDA torch it pins fit setup.py's torch range;
- `pip install .[sglang]`, `.[te]` and `.[sglang,te]` have a solution without a conflict, with
  SGLang no older than the pinned release, Transformer Engine's torch part, and megatron-core
  (the project's own requirements take part: the project's metadata is built from setup.py);
- every command of install.md's GPU block pins the torch the pinned SGLang pins, and resolves.
It does not install anything, build Transformer Engine or run on a GPU.

The resolver is uv (`uv pip compile`, in the [dev] extra), targeting `x86_64-manylinux_2_34` (the
oldest glibc SGLang 0.5.23's wheels accept), whatever machine runs the test. pip's `install
--dry-run --report` was the first choice and is not usable here: the index this machine reaches
as PyPI advertises no PEP 658 metadata files, so pip downloads every wheel it considers (the torch
wheel alone is 555 MB; resolving `[sglang]` took 4.5 minutes; pip before 25.3 downloads them even
when the index advertises metadata), and for `[te]` it installs torch into an isolated build
environment to read Transformer Engine's sdist. uv reads a wheel's METADATA through HTTP range
requests and that sdist's static PKG-INFO: a cold resolve of `[sglang,te]` fetches ~55 MB (almost
all of it index pages) in ~15 s. The sets resolve concurrently: 20-35 s in all, warm or cold.

Skips, saying why, when uv is not installed or PyPI does not answer.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_earl.rollout.sglang.client import SGLANG_PINNED

ROOT = Path(__file__).resolve().parents[2]
INSTALL_MD = ROOT / "megatron_earl" / "docs" / "install.md"
INDEX_URL = "https://pypi.org/simple"
PYTHON_VERSION = "3.11"
PLATFORM = "x86_64-manylinux_2_34"
GPU_BLOCK_HEADING = "### One command per environment kind"

EXTRAS = ("sglang", "te", "sglang,te")
PINNED_SGLANG = f"sglang=={SGLANG_PINNED}"

Resolution = dict[str, Version]
"""A solution: {distribution name: version}."""


def _gpu_commands() -> list[str]:
    """The pip commands of install.md's GPU block (the fenced block after GPU_BLOCK_HEADING)."""
    text = INSTALL_MD.read_text()
    assert GPU_BLOCK_HEADING in text, f"{INSTALL_MD} has no section {GPU_BLOCK_HEADING!r}"
    block = re.search(r"```bash\n(.*?)```", text.split(GPU_BLOCK_HEADING, 1)[1], flags=re.S)
    assert block, f"no bash block under {GPU_BLOCK_HEADING!r}"
    return [line for line in block.group(1).splitlines() if line.startswith("pip install")]


def _requirements(command: str) -> list[str]:
    """The requirements one shell line installs: `.` is this checkout, options are dropped."""
    words = [w for w in shlex.split(command) if w not in ("pip", "install", "&&")]
    return [str(ROOT) + w[1:] if w.startswith(".") else w for w in words if not w.startswith("-")]


@pytest.fixture(scope="module")
def solutions() -> dict[str, Resolution | str]:
    """Every requirement set of this file resolved by uv against PyPI, keyed by the pinned SGLang
    alone, each extras string and each install.md command: the solution, or uv's error text.
    The sets resolve concurrently (network-bound: one at a time takes ~60 s with a cold cache)."""
    uv = pytest.importorskip("uv", reason="uv resolves the extras: pip install -e '.[dev]'")
    try:
        urllib.request.urlopen(urllib.request.Request(f"{INDEX_URL}/", method="HEAD"), timeout=10)
    except (urllib.error.URLError, OSError) as error:
        pytest.skip(f"PyPI unreachable ({INDEX_URL}: {error}): the check resolves against it")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    command = [
        uv.find_uv_bin(),
        *("pip", "compile", "-", "--no-config", "--quiet", "--no-header", "--no-annotate"),
        *("--index-url", INDEX_URL, "--python-version", PYTHON_VERSION),
        *("--python-platform", PLATFORM),
    ]

    def resolve(requirements: list[str]) -> Resolution | str:
        done = subprocess.run(
            command,
            input="\n".join(requirements) + "\n",
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            cwd=ROOT,
        )
        if done.returncode != 0:
            return f"{requirements} do not resolve:\n{done.stderr}"
        pins = re.findall(r"^([A-Za-z0-9._-]+)==(\S+)$", done.stdout, flags=re.M)
        return {name.lower().replace("_", "-"): Version(version) for name, version in pins}

    sets = {PINNED_SGLANG: [PINNED_SGLANG]}
    sets |= {extras: [f"{ROOT}[{extras}]"] for extras in EXTRAS}
    sets |= {command: _requirements(command) for command in _gpu_commands()}
    with ThreadPoolExecutor(len(sets)) as pool:
        return dict(zip(sets, pool.map(resolve, sets.values())))


def _solution(solutions: dict[str, Resolution | str], key: str) -> Resolution:
    solution = solutions[key]
    if isinstance(solution, str):
        pytest.fail(solution)
    return solution


def _setup_torch_range() -> SpecifierSet:
    match = re.search(r'"torch([<>=!~][^"]*)"', (ROOT / "setup.py").read_text())
    assert match, "setup.py names no torch requirement"
    return SpecifierSet(match.group(1))


def test_the_pinned_sglangs_torch_is_in_setups_range(solutions):
    sglang_torch, torch_range = _solution(solutions, PINNED_SGLANG)["torch"], _setup_torch_range()
    assert sglang_torch in torch_range, (
        f"SGLang {SGLANG_PINNED} pins torch {sglang_torch}; setup.py allows torch{torch_range}"
    )


@pytest.mark.parametrize("extras", EXTRAS)
def test_extras_resolve_with_one_torch(solutions, extras: str):
    got = _solution(solutions, extras)
    assert "megatron-core" in got and got["torch"] in _setup_torch_range(), got
    if "sglang" in extras:
        assert got["sglang"] >= Version(SGLANG_PINNED), (
            f"[{extras}] resolves to SGLang {got['sglang']}, older than the pinned {SGLANG_PINNED}"
        )
    if "te" in extras.split(","):
        assert "transformer-engine-torch" in got, got


@pytest.mark.parametrize("command", _gpu_commands())
def test_install_md_gpu_command_resolves(solutions, command: str):
    sglang_torch = _solution(solutions, PINNED_SGLANG)["torch"]
    assert f"torch=={sglang_torch}" in _requirements(command), (
        f"{command!r} must pin torch=={sglang_torch}, the torch SGLang {SGLANG_PINNED} pins"
    )
    got = _solution(solutions, command)
    assert got["torch"] == sglang_torch and got["sglang"] >= Version(SGLANG_PINNED), got
