"""The real-SGLang tier: real ``sglang.launch_server`` processes (the pinned release, CPU build)
started on 127.0.0.1 from the venv ``scripts/install_sglang_cpu.sh`` builds, and the project's
trainer, transports and client driving them.

The venv's python is ``$EARL_SGLANG_PYTHON``, else the installer's default
(``~/.cache/megatron-earl/sglang-<version>/bin/python``). Without it every test here is skipped,
naming the install command -- unless ``$EARL_REQUIRE_SGLANG`` is set (CI sets it: ``.ci/run``
installs SGLang first), where a missing venv fails the tier instead.

The engines serve the tiny model of ``MODEL_RUN`` (the switching demo's config at 2 layers)
written by ``convert.engine_model`` (random weights, the demo tokenizer's files and its
end-of-sequence ids); every test that needs particular weights pushes them first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_earl.rollout.sglang.client import SGLANG_PINNED
from megatron_earl.rollout.sglang.launcher import (
    SGLANG_CPU_ENV,
    LaunchConfig,
    ServerProcess,
    sglang_cpu_args,
    stop_all,
)
from megatron_earl.testing.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = "EARL_SGLANG_PYTHON"
REQUIRE_ENV = "EARL_REQUIRE_SGLANG"
DEFAULT_PYTHON = Path.home() / ".cache" / "megatron-earl" / f"sglang-{SGLANG_PINNED}" / "bin/python"
KEY = "real-sglang-test-key"
MODEL_RUN = (
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
)
"""Overrides of ``configs/demo_cpu_switching.yaml`` giving the engines' (and trainers') model."""
START_TIMEOUT_S = 300.0
"""An engine's start-up (~25-40 s on 2 busy cores, ~25 s of it imports)."""


def sglang_python() -> str | None:
    path = os.environ.get(PYTHON_ENV) or str(DEFAULT_PYTHON)
    return path if Path(path).is_file() else None


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    python = sglang_python()
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        item.add_marker(pytest.mark.sglang)
        if python is None and not os.environ.get(REQUIRE_ENV):
            item.add_marker(
                pytest.mark.skip(
                    reason=f"no SGLang {SGLANG_PINNED} venv at {DEFAULT_PYTHON} (or "
                    f"${PYTHON_ENV}): run bash scripts/install_sglang_cpu.sh"
                )
            )


@pytest.fixture(scope="session")
def python() -> str:
    path = sglang_python()
    if path is None:
        pytest.fail(
            f"${REQUIRE_ENV} is set but there is no SGLang venv at {DEFAULT_PYTHON} (or "
            f"${PYTHON_ENV}); run bash scripts/install_sglang_cpu.sh"
        )
    return path


@pytest.fixture(scope="session")
def run_config():
    from megatron_earl.config.loader import load_config

    return load_config(ROOT / "configs" / "demo_cpu_switching.yaml", list(MODEL_RUN))


@pytest.fixture(scope="session")
def engine_model(run_config, tmp_path_factory) -> Path:
    from megatron_earl.convert.engine_model import write_engine_model

    return write_engine_model(
        run_config.model, run_config.tokenizer, tmp_path_factory.mktemp("engine") / "model"
    )


TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
"""SGLang's CPU path starts more TP ranks than the machine has NUMA nodes only with each rank's
cores named (here: one core per rank)."""


def start_engines(
    python: str,
    model_dir: Path,
    log_dir: Path,
    count: int,
    *,
    api_key: str | None = KEY,
    tp_size: int = 1,
) -> list[ServerProcess]:
    """``count`` real SGLang servers on ``model_dir``, healthy (started concurrently)."""
    procs = [
        ServerProcess(
            LaunchConfig(
                model_path=str(model_dir),
                port=free_port(),
                api_key=api_key,
                python=python,
                tp_size=tp_size,
                extra_args=sglang_cpu_args(max_total_tokens=8192),
            ),
            env={**SGLANG_CPU_ENV, "OMP_NUM_THREADS": "1", **(TP2_ENV if tp_size > 1 else {})},
            log_path=str(log_dir / f"sglang{i}.log"),
            rebind_on_conflict=True,
        )
        for i in range(count)
    ]
    try:
        for proc in procs:
            proc.wait_healthy(timeout_s=START_TIMEOUT_S, path="/health")
    except BaseException:
        stop_all(procs)
        raise
    return procs


@pytest.fixture(scope="session")
def engines(python, engine_model, tmp_path_factory):
    """Two real SGLang servers for the whole tier (keyed with ``KEY``)."""
    procs = start_engines(python, engine_model, tmp_path_factory.mktemp("logs"), 2)
    try:
        yield procs
    finally:
        stop_all(procs, stop_timeout_s=30)
