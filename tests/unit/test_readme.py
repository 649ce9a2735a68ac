"""The README's two set-up commands exist, and .ci/run runs exactly the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [
        line for block in blocks for line in block.splitlines() if line.startswith("pip install")
    ]


def test_readme_has_main_job_and_test_commands():
    commands = _readme_commands()
    assert any("megatron-earl" in c for c in commands), commands
    assert any("pytest" in c for c in commands), commands
    for command in commands:
        assert "torch==2.13.0" in command, f"install path must pin torch: {command}"


def test_ci_runs_the_readme_test_command():
    test_command = next(c for c in _readme_commands() if "pytest" in c)
    ci_lines = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith("#") and not line.startswith(("set ", "cd "))
    ]
    assert ci_lines == [test_command]
