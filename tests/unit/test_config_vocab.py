"""``config/`` is a leaf, and the phase / engine-kind vocabulary is the only spelling of those
words in the code: AST scans of the package, plus the start-up errors for unknown names."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from megatron_earl.config import ConfigError, RunConfig, dump_config, load_config
from megatron_earl.config.run import DEMO_TOKENIZER_VOCAB_SIZE, SelectorSettings, layout_sizes
from megatron_earl.config.vocab import ENGINE_KINDS, PHASES, EngineKind, Phase
from megatron_earl.orchestration.validate import run_problems, validate_run
from megatron_earl.parallel.layout import LayoutError, ParallelLayout, phase_layout

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_earl"

VOCABULARY_MODULES = {"config/vocab.py", "config/loader.py"}
"""The vocabulary's definition and the YAML parser: the words may be spelled out there."""
NOT_A_VOCABULARY_WORD = {
    ("cli/main.py", "train"): "the `megatron-earl train` subcommand",
    ("bench/async_rl.py", "train"): "the `megatron-earl train` subcommand it runs",
    ("bench/fault_suite.py", "train"): "the `megatron-earl train` subcommand it runs",
    ("compat/optional.py", "sglang"): "the name of the sglang Python package",
    ("config/run.py", "rollout"): "the name of the RunConfig section `rollout` in its errors",
    ("config/run.py", "train"): "the name of the RunConfig section `train` in its errors",
    ("rollout/serve/model.py", "sglang"): "the `owned_by` of SGLang's OpenAI model card",
}
"""(module, literal) pairs where the word names something else."""


def _modules(sub: str = "") -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py"))


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])


def _imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """Every module ``source`` (a module of ``package``) imports: top level, lazy (inside
    functions), under TYPE_CHECKING; relative imports resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
            out.append((node.lineno, name))
    return out


def test_config_imports_nothing_else_of_the_project():
    bad = [
        f"{path.relative_to(PACKAGE)}:{line}: {name}"
        for path in _modules("config")
        for line, name in _imported_modules(path.read_text(), _package_of(path))
        if name.split(".")[0] == "megatron_earl"
        and not (name == "megatron_earl.config" or name.startswith("megatron_earl.config."))
    ]
    assert not bad, "config/ must be a leaf; it imports:\n" + "\n".join(bad)


def test_the_import_scan_sees_lazy_and_relative_imports():
    path = PACKAGE / "config" / "run.py"
    found = {name for _, name in _imported_modules(path.read_text(), _package_of(path))}
    assert "megatron_earl.config.vocab" in found  # the scan does see config's own imports
    source = "def f():\n    from ..envs import ENVS\n    import megatron_earl.training.losses\n"
    found = {name for _, name in _imported_modules(source, "megatron_earl.config")}
    assert {"megatron_earl.envs", "megatron_earl.training.losses"} <= found


def test_no_phase_or_engine_literals_outside_the_vocabulary():
    words = {str(w) for w in (*PHASES, *ENGINE_KINDS)}
    found = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in VOCABULARY_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in words and (rel, node.value) not in NOT_A_VOCABULARY_WORD:
                    found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, "use config.vocab.Phase / EngineKind instead of:\n" + "\n".join(found)


def test_vocabulary_members_are_their_strings():
    assert PHASES == (Phase.ROLLOUT, Phase.EXPERIENCE, Phase.TRAIN)
    assert Phase("train") is Phase.TRAIN and Phase.TRAIN == "train"
    assert f"time/{Phase.EXPERIENCE}" == "time/experience"
    assert {Phase.TRAIN: 1}["train"] == 1
    assert json.dumps({Phase.ROLLOUT: [EngineKind.SGLANG]}) == '{"rollout": ["sglang"]}'
    assert repr(PHASES) == "('rollout', 'experience', 'train')"


@pytest.mark.parametrize(
    ("cls", "name", "valid"),
    [(Phase, "trian", "rollout, experience, train"), (EngineKind, "vllm", "embedded, sglang")],
)
def test_unknown_name_lists_the_valid_ones(cls, name, valid):
    with pytest.raises(ValueError, match=f"unknown {cls.__name__} '{name}'; valid: {valid}"):
        cls(name)


def test_unknown_phase_or_engine_in_a_config_is_a_clear_error():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["selector.phases=[train,trian]", "rollout.engine=vllm"])
    text = str(err.value)
    assert "2 problems" in text
    assert "selector: phases ['train', 'trian'] must be a non-empty subset of " in text
    assert "('rollout', 'experience', 'train')" in text
    assert "rollout: engine 'vllm' is not one of ('embedded', 'sglang')" in text
    with pytest.raises(ConfigError, match=r"rollout\.engine: expected one of embedded, sglang"):
        load_config(None, ["rollout.engine=3"])
    with pytest.raises(ConfigError, match="unknown phase 'eval'; valid: "):
        RunConfig().layouts.of("eval")


def test_names_become_members_and_dump_as_plain_strings(tmp_path):
    cfg = load_config(None, ["selector.phases=[rollout,train]", "rollout.engine=sglang"])
    assert cfg.selector.phases == (Phase.ROLLOUT, Phase.TRAIN)
    assert all(type(p) is Phase for p in cfg.selector.phases)
    assert cfg.rollout.engine is EngineKind.SGLANG
    assert SelectorSettings(phases=("experience",)).phases[0] is Phase.EXPERIENCE
    text = dump_config(cfg)
    assert "engine: sglang" in text and "- rollout" in text and "Phase" not in text
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert load_config(path) == cfg


def test_layout_strings_parse_in_config_and_build_in_parallel():
    assert layout_sizes("tp2dp2") == {
        "tp": 2, "cp": 1, "pp": 1, "dp": 2, "vpp": None, "ep": 1, "etp": None
    }  # fmt: skip
    with pytest.raises(ConfigError, match="layouts: train: cannot parse layout 'tp2zz'"):
        load_config(None, ["layouts.train=tp2zz"])
    cfg = load_config(None, ["layouts.train=tp2", "layouts.experience=pp2vpp2"])
    assert phase_layout(cfg.layouts, Phase.TRAIN) == ParallelLayout(tp=2)
    assert phase_layout(cfg.layouts, Phase.EXPERIENCE) == ParallelLayout(pp=2, vpp=2)


def test_impossible_layout_values_are_a_start_up_error():
    cfg = load_config(None, ["layouts.train=ep0"])
    with pytest.raises(LayoutError, match=r"parallel sizes must be integers >= 1, got \{'ep': 0\}"):
        phase_layout(cfg.layouts, Phase.TRAIN)
    problems = run_problems(cfg, 1)
    assert any(p.startswith("layouts.train 'ep0': parallel sizes must be") for p in problems)


def test_unknown_advantage_estimator_is_a_start_up_error():
    cfg = load_config(None, ["train.advantage=ppo_gae"])
    with pytest.raises(ConfigError, match=r"train: advantage 'ppo_gae': advantage estimator"):
        validate_run(cfg, world_size=1)
    cfg = load_config(None, ["train.advantage_kwargs={bogus: 1}"])
    assert any("train: advantage 'grpo'" in p and "bogus" in p for p in run_problems(cfg, 1))


def test_default_vocab_is_the_demo_tokenizers():
    from megatron_earl.tokenizer.demo import DemoTokenizer

    assert DemoTokenizer().vocab_size == DEMO_TOKENIZER_VOCAB_SIZE == RunConfig().model.vocab_size
