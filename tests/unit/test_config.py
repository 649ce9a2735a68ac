"""RunConfig from YAML + dotted overrides: strict keys and types, one error listing every problem,
resolved-config round trip, and start-up validation against the world size (pure, no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_earl.config import (
    ConfigError,
    RunConfig,
    config_to_tree,
    dump_config,
    load_config,
    save_config,
)
from megatron_earl.config.vocab import Phase
from megatron_earl.orchestration.validate import run_problems, validate_run
from megatron_earl.parallel.layout import ParallelLayout, phase_layout

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_without_a_file():
    cfg = load_config()
    assert cfg == RunConfig()
    assert phase_layout(cfg.layouts, Phase.TRAIN) == ParallelLayout()


def test_demo_config_loads_and_fits_two_ranks():
    cfg = load_config(CONFIGS / "demo_cpu.yaml")
    assert cfg.selector.enabled and set(cfg.selector.phases) == set(Phase)
    assert all(phase_layout(cfg.layouts, p) == ParallelLayout(dp=2) for p in Phase)
    assert cfg.env.spec() == {"name": "arithmetic", "kwargs": {"difficulty": 2}}
    validate_run(cfg, world_size=2)


def test_switching_demo_is_the_demo_with_pinned_layouts():
    demo = config_to_tree(load_config(CONFIGS / "demo_cpu.yaml"))
    switching = load_config(CONFIGS / "demo_cpu_switching.yaml")
    assert not switching.selector.enabled
    assert phase_layout(switching.layouts, Phase.ROLLOUT) == ParallelLayout(dp=2)
    assert phase_layout(switching.layouts, Phase.EXPERIENCE) == ParallelLayout(tp=2)
    assert phase_layout(switching.layouts, Phase.TRAIN) == ParallelLayout(tp=2)
    validate_run(switching, world_size=2)
    tree = config_to_tree(switching)
    differ = {key for key in demo if demo[key] != tree[key]}
    assert differ == {"name", "layouts", "selector"}


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_loads(name):
    cfg = load_config(CONFIGS / name)
    assert load_config(None, [f"{k}={v}" for k, v in _dotted(config_to_tree(cfg))]) == cfg


def test_dotted_overrides_are_typed():
    cfg = load_config(
        CONFIGS / "demo_cpu.yaml",
        [
            "train.lr=1e-4",
            "rollout.max_turns=4",
            "train.loss.kl_coef=0.01",
            "rollout.sampling.stop_token_ids=[1,3]",
            "env.kwargs.difficulty=3",
            "checkpoint.load=null",
            "model.rotary_base=500000",  # an int where a float is expected: accepted as float
        ],
    )
    assert cfg.train.lr == 1e-4 and cfg.rollout.max_turns == 4
    assert cfg.train.loss.kl_coef == 0.01
    assert cfg.rollout.sampling.stop_token_ids == (1, 3)
    assert cfg.env.kwargs == {"difficulty": 3}
    assert isinstance(cfg.model.rotary_base, float)
    assert cfg.model.num_layers == 4  # untouched keys keep the file's values


def test_train_config_is_an_optim_config():
    from megatron_earl.config.optim import OptimConfig

    cfg = load_config(None, ["train.lr=0.5", "train.weight_decay=0.1"])
    assert isinstance(cfg.train, OptimConfig)
    assert cfg.train.optim() == OptimConfig(lr=0.5, weight_decay=0.1)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("train.lrr=1e-4", "unknown key 'train.lrr'; did you mean 'train.lr'?"),
        ("rollout.max_turn=4", "unknown key 'rollout.max_turn'; did you mean 'rollout.max_turns'?"),
        ("max_turns=4", "unknown key 'max_turns'; did you mean 'rollout.max_turns'?"),
        ("modle.num_layers=2", "unknown key 'modle'; did you mean 'model'?"),
        ("train.loss.kl_coeff=0.1", "did you mean 'train.loss.kl_coef'?"),
    ],
)
def test_unknown_keys_suggest_the_nearest_valid_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("rollout.max_turns=four", "rollout.max_turns: expected int, got 'four' (str)"),
        ("model.hidden_size=1.5", "model.hidden_size: expected int, got 1.5 (float)"),
        ("train.lr=fast", "train.lr: expected float, got 'fast' (str)"),
        ("logging.jsonl=1", "logging.jsonl: expected bool, got 1 (int)"),
        ("seed=true", "seed: expected int, got True (bool)"),
        ("model.num_query_groups=x", "expected int | None, got 'x' (str)"),
        ("rollout.engine_urls=5", "rollout.engine_urls: expected a list of str, got 5 (int)"),
        ("env.kwargs=3", "env.kwargs: expected a mapping, got 3 (int)"),
        ("rollout.sampling=3", "rollout.sampling: expected a mapping (section SamplingParams)"),
        # Non-finite numbers pass every range check after them (issue 22): refused by name.
        ("train.lr=.nan", "train.lr: must be a finite number, got nan"),
        ("train.lr=.inf", "train.lr: must be a finite number, got inf"),
        ("train.clip_grad=-.inf", "train.clip_grad: must be a finite number, got -inf"),
        ("eval.temperature=.nan", "eval.temperature: must be a finite number, got nan"),
        ("rollout.sampling.temperature=.inf", "sampling.temperature: must be a finite number"),
        ("rollout.max_empty_steps=-1", "rollout: max_empty_steps (-1) must be >= 0"),
    ],
)
def test_wrong_types_name_key_value_and_type(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


def test_section_validation_names_the_section():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["batch.samples_per_prompt=0", "rollout.engine=vllm", "train.lr=-1"])
    text = str(err.value)
    assert "3 problems" in text
    assert "batch: samples_per_prompt (0) must be >= 1" in text
    assert "rollout: engine 'vllm' is not one of ('embedded', 'sglang')" in text
    assert "train: lr must be > 0, got -1.0" in text


@pytest.mark.parametrize(
    "overrides, computed",
    [
        ([], False),  # one mini-batch, no dropout: the train pass's own log-probs are pi_old
        (["train.old_logprobs=always"], True),
        (["batch.num_mini_batches=2"], True),  # mini-batch 2 trains on updated weights
        (["model.hidden_dropout=0.1"], True),  # two forwards draw different dropout masks
        (["model.attention_dropout=0.1"], True),
        (["train.loss.tis_cap=2.0", "train.loss.loss_type=gspo"], False),
        (["train.loss.kl_coef=0.1"], False),  # the reference pass is separate
    ],
)
def test_old_logprobs_pass_decision(overrides, computed):
    cfg = load_config(None, overrides)
    assert cfg.old_logprobs_pass() is computed


def test_old_logprobs_setting_is_validated():
    assert load_config(None, ["train.old_logprobs=always"]).train.old_logprobs == "always"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.old_logprobs=never"])
    assert "train: old_logprobs 'never' is not one of ('auto', 'always')" in str(err.value)


def test_every_problem_in_one_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("stepz: 3\nmodel:\n  hidden_size: big\ntrain:\n  lr: 1e-4\n  foo: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert "3 problems" in text
    assert "unknown key 'stepz'; did you mean 'steps'?" in text
    assert "model.hidden_size: expected int, got 'big' (str)" in text
    assert "unknown key 'train.foo'" in text


def test_bad_files_and_overrides():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/run.yaml")
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["train.lr"])


def test_interpolation_resolves(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("layouts:\n  train: tp2dp1\n  experience: ${layouts.train}\n")
    cfg = load_config(path)
    assert cfg.layouts.experience == "tp2dp1"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(
        CONFIGS / "demo_cpu.yaml",
        [
            "train.lr=3e-5",
            "rollout.engine=sglang",
            "rollout.engine_urls=[http://a:30000,http://b:30000]",
            "rollout.sampling.stop_token_ids=[3]",
            "train.loss.dual_clip_c=3.0",
            "train.advantage_kwargs={scale_by_std: false}",
            "name=round trip",
        ],
    )
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    again = load_config(path)
    assert again == cfg
    assert dump_config(again) == dump_config(cfg)
    assert again.rollout.engine_urls == ("http://a:30000", "http://b:30000")


def test_run_paths():
    cfg = load_config(None, ["output_dir=/tmp/o", "name=r1"])
    assert cfg.run_dir == Path("/tmp/o/r1")
    assert cfg.checkpoint_dir == Path("/tmp/o/r1/checkpoints")
    assert cfg.tensorboard_dir == Path("/tmp/o/r1/tensorboard")


def test_layout_that_does_not_fit_the_world_names_a_valid_one():
    cfg = load_config(CONFIGS / "demo_cpu_switching.yaml")
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, world_size=4)
    text = str(err.value)
    assert "cannot run on 4 ranks" in text
    assert "layouts.rollout 'tp1cp1pp1dp2'" in text and "!= world size (4)" in text
    assert "layouts.train 'tp2cp1pp1dp1'" in text and "nearest valid: 'tp2cp1pp1dp2'" in text


def test_layout_that_does_not_fit_the_model():
    cfg = load_config(None, ["layouts.train=tp8", "model.num_attention_heads=4"])
    problems = run_problems(cfg, 8)
    assert any("num_attention_heads (4) % tp (8) != 0" in p for p in problems)


def test_start_up_errors_are_collected():
    cfg = load_config(
        None,
        [
            "checkpoint.load=/nonexistent/ckpt",
            "env.name=arithmatic",
            "batch.samples_per_prompt=1",
            "layouts.train=dp4",
            "layouts.experience=dp4",
            "layouts.rollout=dp4",
            "batch.prompts_per_step=2",
            "model.vocab_size=100",
        ],
    )
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, world_size=4)
    text = str(err.value)
    assert "checkpoint path '/nonexistent/ckpt' does not exist" in text
    assert "unknown environment 'arithmatic'" in text
    assert "batch.samples_per_prompt (1) must be >= 2" in text
    assert "has dp=4 but a step has only 2 samples" in text
    assert "model.vocab_size (100) < the demo tokenizer's vocabulary" in text


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (["env.kwargs.dificulty=3"], "TypeError: ArithmeticEnv.__init__() got an unexpected"),
        (["env.kwargs.difficulty=hard"], "TypeError: '<=' not supported"),
        (["env.kwargs.difficulty=9"], "ValueError: difficulty must be in [1, 8]"),
    ],
)
def test_env_kwargs_are_checked_at_pre_flight(kwargs, fragment):
    """The environment is constructed with env.kwargs before any process starts (issue 22)."""
    cfg = load_config(None, kwargs)
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, world_size=1)
    assert "env.kwargs {" in str(err.value)
    assert "constructing env.name='arithmetic' raised" in str(err.value)
    assert fragment in str(err.value)
    validate_run(load_config(None, ["env.kwargs.difficulty=3"]), world_size=1)


def test_existing_checkpoint_path_is_accepted(tmp_path):
    cfg = load_config(None, [f"checkpoint.load={tmp_path}"])
    validate_run(cfg, world_size=1)


def _dotted(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict) and value and key not in ("kwargs", "advantage_kwargs"):
            yield from _dotted(value, f"{prefix}{key}.")
        elif isinstance(value, dict):
            inner = ",".join(f"{k}: {v}" for k, v in value.items())
            yield f"{prefix}{key}", "{" + inner + "}"
        elif isinstance(value, list):
            yield f"{prefix}{key}", "[" + ",".join(str(v) for v in value) + "]"
        elif value is None:
            yield f"{prefix}{key}", "null"
        else:
            yield f"{prefix}{key}", value


def test_every_key_is_documented():
    from megatron_earl.config.loader import _all_paths

    doc = (Path(__file__).resolve().parents[2] / "megatron_earl/docs/configuration.md").read_text()
    missing = [p for p in _all_paths(RunConfig) if f"`{p}`" not in doc and f"**{p}**" not in doc]
    assert not missing, f"keys missing from docs/configuration.md: {missing}"


@pytest.mark.parametrize(
    "name,world_size", [("qwen2.5-7b_grpo.yaml", 8), ("qwen2.5-7b_grpo_disagg.yaml", 16)]
)
def test_gpu_configs_fit_their_world(name, world_size):
    """Layouts fit the model and world; only the HF tokenizer directory is absent here (the
    disaggregated config gets its engine URLs from the launch script, as in production)."""
    overrides = ["rollout.engine_urls=[http://node03:30000]"] if "disagg" in name else []
    problems = run_problems(load_config(CONFIGS / name, overrides), world_size)
    assert len(problems) == 1 and "Qwen2.5-7B-Instruct' is neither 'demo'" in problems[0]


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("runtime.collective_timeout_s=0", "runtime: collective_timeout_s (0.0) must be a finite"),
        ("runtime.collective_timeout_s=-5", "collective_timeout_s (-5.0) must be"),
        ("runtime.collective_timeout_s=.inf", "collective_timeout_s: must be a finite number"),
        ("runtime.watchdog_timeout_s=0", "runtime: watchdog_timeout_s (0.0) must be"),
        ("checkpoint.on_signal_grace_s=-1", "checkpoint: on_signal_grace_s (-1.0) must be"),
    ],
)
def test_non_positive_timeouts_are_refused_by_name(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


def test_watchdog_can_be_disabled():
    assert load_config(None, ["runtime.watchdog_timeout_s=null"]).runtime.watchdog_timeout_s is None
    assert RunConfig().runtime.collective_timeout_s == 1800.0
    assert RunConfig().checkpoint.on_signal is False
