"""Rollout backends (``orchestration.engines``): the registry of engine kinds, chosen once at
start-up, and each kind's start-up checks, reached through the trainer's pre-flight
(``cli.train.checked_config``). Pure: no process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_earl.cli.train import checked_config
from megatron_earl.config import ConfigError, load_config
from megatron_earl.config.vocab import Phase
from megatron_earl.orchestration.engines import (
    RolloutBackend,
    available_rollout_backends,
    register_rollout_backend,
    rollout_backend_class,
    rollout_backend_problems,
)
from megatron_earl.orchestration.engines.embedded import EmbeddedBackend, engine_config
from megatron_earl.orchestration.engines.sglang import SGLangBackend
from megatron_earl.parallel.layout import ParallelLayout, phase_layout

# pinned layouts (the selector off): the engine constraints on a fixed rollout layout
DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu_switching.yaml")
ROOT = Path(__file__).resolve().parents[2]
URLS = "rollout.engine_urls=[http://a:30000]"


def test_every_engine_name_is_registered_and_accepted_by_the_config():
    assert available_rollout_backends() == ("embedded", "sglang")
    assert rollout_backend_class("embedded") is EmbeddedBackend
    assert rollout_backend_class("sglang") is SGLangBackend
    for name in available_rollout_backends():
        extra = [URLS] if name == "sglang" else []
        config = load_config(DEMO, [f"rollout.engine={name}", *extra])
        assert rollout_backend_problems(config) == []


def test_unknown_engine_names_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        rollout_backend_class("vllm")
    assert str(err.value) == (
        "rollout.engine 'vllm' is not a registered rollout engine; valid: ('embedded', 'sglang')"
    )
    with pytest.raises(ConfigError, match="'vllm'"):
        load_config(DEMO, ["rollout.engine=vllm"])


def test_a_kind_registers_once_and_implements_the_whole_interface():
    with pytest.raises(ValueError, match="'embedded' is already registered"):
        register_rollout_backend(type("Again", (EmbeddedBackend,), {}))

    class Partial(RolloutBackend):
        name = "partial"

    with pytest.raises(TypeError, match="abstract"):
        Partial(None, None, None)


def test_policy_layouts_of_each_kind():
    config = load_config(DEMO)
    phases = {p: phase_layout(config.layouts, p) for p in Phase}
    assert EmbeddedBackend.policy_layouts(phases) == phases
    assert SGLangBackend.policy_layouts(phases) == {
        "experience": phases["experience"],
        "train": phases["train"],
    }


def test_embedded_engine_needs_a_tp_dp_rollout_layout():
    with pytest.raises(ConfigError) as err:
        checked_config(["--config", DEMO, "layouts.rollout=tp1cp1pp2dp1"], 2)
    assert str(err.value) == (
        "layouts.rollout 'tp1cp1pp2dp1': the embedded engine generates with tp and dp only "
        "(pp=2, cp=1); use e.g. 'tp2cp1pp1dp1'"
    )
    config = load_config(DEMO, ["layouts.rollout=tp1cp2pp1dp1"])
    assert rollout_backend_problems(config) == [
        "layouts.rollout 'tp1cp2pp1dp1': the embedded engine generates with tp and dp only "
        "(pp=1, cp=2); use e.g. 'tp2cp1pp1dp1'"
    ]


def test_sglang_engines_need_urls_and_a_fixed_rollout_layout():
    with pytest.raises(ConfigError) as err:
        checked_config(["--config", DEMO, "rollout.engine=sglang"], 2)
    assert str(err.value) == (
        "rollout.engine=sglang needs rollout.engine_urls (the SGLang servers to drive, e.g. "
        "from scripts/slurm_disaggregated.sbatch); the trainer does not start colocated "
        "SGLang servers itself"
    )
    selected = load_config(
        DEMO,
        [
            "rollout.engine=sglang",
            URLS,
            "selector.enabled=true",
            "selector.phases=[rollout,experience]",
        ],
    )
    assert rollout_backend_problems(selected) == [
        "selector.phases ['rollout', 'experience'] selects the rollout layout, which needs "
        "rollout.engine=embedded (got 'sglang'); select 'experience' only with SGLang engines"
    ]
    checked_config(["--config", DEMO, "rollout.engine=sglang", URLS], 2)


def test_embedded_engine_settings_come_from_the_run_config():
    """``rollout.embedded`` reaches each layout's engine: decode threads everywhere, the compiled
    decode and prefill steps on tp1 layouts only (a tp > 1 engine the selector picks runs
    eagerly), steps in the engine's worker thread; a pinned tp > 1 rollout layout with
    ``compile_decode`` or ``compile_prefill`` is refused before anything starts."""
    config = load_config(
        DEMO,
        [
            "layouts.rollout=tp1cp1pp1dp2",
            "rollout.embedded.compile_decode=true",
            "rollout.embedded.compile_prefill=true",
            "rollout.embedded.decode_threads=2",
            "rollout.max_concurrency=100",
        ],
    )
    tp1, tp2 = ParallelLayout(dp=2), ParallelLayout(tp=2)
    settings = engine_config(config, tp1)
    assert (settings.compile_decode, settings.compile_prefill, settings.decode_threads) == (
        True,
        True,
        2,
    )
    assert (settings.max_batch_size, settings.max_seq_len) == (64, config.rollout.max_context)
    assert settings.step_thread  # the agent loops' timeouts keep running during a step
    assert not engine_config(config, tp2).compile_decode
    assert not engine_config(config, tp2).compile_prefill
    assert not engine_config(load_config(DEMO), tp1).compile_decode
    assert not engine_config(load_config(DEMO), tp1).compile_prefill
    assert engine_config(load_config(DEMO), tp1).decode_threads == 1
    assert rollout_backend_problems(config) == []

    with pytest.raises(ConfigError) as err:
        checked_config(
            [
                "--config",
                DEMO,
                "layouts.rollout=tp2cp1pp1dp1",
                "rollout.embedded.compile_decode=true",
            ],
            2,
        )
    assert str(err.value) == (
        "rollout.embedded.compile_decode needs a tp1 rollout layout (the compiled step holds no "
        "TP collectives), got layouts.rollout 'tp2cp1pp1dp1'; use 'tp1cp1pp1dp2', let the "
        "selector choose the rollout layout, or set compile_decode: false"
    )
    selected = load_config(
        DEMO,
        [
            "layouts.rollout=tp2cp1pp1dp1",
            "rollout.embedded.compile_decode=true",
            "selector.enabled=true",
            "selector.phases=[rollout,experience,train]",
        ],
    )
    assert rollout_backend_problems(selected) == []
    with pytest.raises(ConfigError) as err:
        checked_config(
            [
                "--config",
                DEMO,
                "layouts.rollout=tp2cp1pp1dp1",
                "rollout.embedded.compile_prefill=true",
            ],
            2,
        )
    assert "rollout.embedded.compile_prefill needs a tp1 rollout layout" in str(err.value)
    assert str(err.value).endswith("or set compile_prefill: false")
    with pytest.raises(ConfigError, match=r"decode_threads \(-1\) must be an integer >= 0"):
        load_config(DEMO, ["rollout.embedded.decode_threads=-1"])
    with pytest.raises(ConfigError, match=r"compile_prefill: expected bool, got 2 \(int\)"):
        load_config(DEMO, ["rollout.embedded.compile_prefill=2"])


def test_launch_scripts_pre_flight_makes_the_engine_checks(capsys):
    """``cli.check`` (what train_local.sh and the sbatch scripts run before srun) makes every check
    ``megatron-earl train`` makes, the engine kind's included."""
    from megatron_earl.cli.check import main as pre_flight

    demo = ["--world-size", "2", "--config", str(ROOT / "configs" / "demo_cpu.yaml")]
    assert pre_flight([*demo, "rollout.engine=sglang"]) == 2
    assert "rollout.engine=sglang needs rollout.engine_urls" in capsys.readouterr().err
    assert pre_flight([*demo, "layouts.rollout=pp2"]) == 2
    assert "the embedded engine generates with tp and dp only" in capsys.readouterr().err
    assert pre_flight(demo) == 0
    assert "config ok" in capsys.readouterr().out


def test_every_kind_has_a_module_and_checks():
    from megatron_earl.config.vocab import EngineKind
    from megatron_earl.orchestration.engines.base import BACKEND_MODULES
    from megatron_earl.orchestration.engines.checks import CHECKS

    assert set(BACKEND_MODULES) == set(CHECKS) == set(EngineKind)


def test_the_pre_flight_imports_no_megatron_or_engine_runtime():
    """``megatron-earl train`` checks the config in its launcher before torchrun: that must not
    pay Megatron-Core's import or the engines' HTTP stacks."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from megatron_earl.cli.train import checked_config\n"
        f"for engine in ({DEMO!r}, 'rollout.engine=sglang'):\n"
        f"    extra = [] if engine == {DEMO!r} else [engine, {URLS!r}]\n"
        f"    checked_config(['--config', {DEMO!r}, *extra], 2)\n"
        "heavy = ('megatron.core', 'aiohttp', 'transformers')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
