"""Typed configuration: the model config, the whole-run ``RunConfig`` with YAML loading and dotted
overrides, start-up validation, and the Megatron-LM argument bridge (``megatron_args``).

    from megatron_earl.config import load_config, validate_run
    cfg = load_config("configs/demo_cpu.yaml", ["train.lr=1e-4"])
    validate_run(cfg, world_size=2)
"""

from megatron_earl.config.loader import (
    config_from_tree,
    config_to_tree,
    dump_config,
    load_config,
    save_config,
)
from megatron_earl.config.model import ModelConfig, ModelConfigError
from megatron_earl.config.run import (
    PHASES,
    BatchConfig,
    CheckpointConfig,
    ConfigError,
    EnvConfig,
    EvalConfig,
    LayoutsConfig,
    LoggingConfig,
    RolloutConfig,
    RunConfig,
    SelectorSettings,
    SFTConfig,
    TrainConfig,
)
from megatron_earl.config.validate import run_problems, validate_run

__all__ = [
    "PHASES",
    "BatchConfig",
    "CheckpointConfig",
    "ConfigError",
    "EnvConfig",
    "EvalConfig",
    "LayoutsConfig",
    "LoggingConfig",
    "ModelConfig",
    "ModelConfigError",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SelectorSettings",
    "TrainConfig",
    "config_from_tree",
    "config_to_tree",
    "dump_config",
    "load_config",
    "run_problems",
    "save_config",
    "validate_run",
]
