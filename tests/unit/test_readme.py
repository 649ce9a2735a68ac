"""The README's two set-up commands exist, the main job installs what the demo config uses,
.ci/run runs exactly the README's test command, which installs the system packages first, and
that install step never fails the command."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


SYSTEM_DEPS = "bash scripts/install_system_deps.sh"


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [
        line
        for block in blocks
        for line in block.splitlines()
        if line.startswith(("pip install", f"{SYSTEM_DEPS} && pip install"))
    ]


def test_readme_has_main_job_and_test_commands():
    commands = _readme_commands()
    assert any("megatron-earl" in c for c in commands), commands
    assert any("pytest" in c for c in commands), commands
    for command in commands:  # an unpinned torch resolves to another build than the one tested
        assert re.search(r"torch==\d+\.\d+\.\d+", command), f"unpinned torch: {command}"
        if "megatron-earl" in command or "pytest" in command:  # the CPU demo and the test tier
            assert "torch==2.13.0" in command, command


def test_ci_runs_the_readme_test_command():
    test_command = next(c for c in _readme_commands() if "pytest" in c)
    ci_lines = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith("#") and not line.startswith(("set ", "cd "))
    ]
    assert ci_lines == [test_command]


def test_main_job_installs_what_the_demo_config_uses():
    main_job = next(c for c in _readme_commands() if "megatron-earl train" in c)
    config_path = re.search(r"--config (\S+)", main_job).group(1)
    config = yaml.safe_load((ROOT / config_path).read_text())
    match = re.search(r'-e "\.\[([\w,-]+)\]"', main_job)
    extras = set(match.group(1).split(",")) if match else set()
    if config.get("logging", {}).get("tensorboard", True):  # LoggingConfig.tensorboard defaults on
        assert "tensorboard" in extras, f"{config_path} writes TensorBoard events: {main_job}"
    setup = (ROOT / "setup.py").read_text()
    for extra in extras:
        assert f'"{extra}": [' in setup, f"setup.py has no extra {extra!r}"


def test_test_command_installs_system_packages_harmlessly(tmp_path):
    test_command = next(c for c in _readme_commands() if "pytest" in c)
    assert test_command.startswith(f"{SYSTEM_DEPS} && "), test_command
    script = ROOT / "scripts" / "install_system_deps.sh"
    # No apt-get on PATH (nor bwrap): a note, and exit status 0.
    (tmp_path / "id").symlink_to("/usr/bin/id")
    bare = subprocess.run(
        ["/bin/bash", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    assert bare.returncode == 0 and "missing bubblewrap, not installed" in bare.stderr, bare
