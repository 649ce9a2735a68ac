"""Typed configuration: the model config, the component settings (``SamplingParams``,
``PolicyLossConfig``, ``OptimConfig``), the whole-run ``RunConfig`` with YAML loading and dotted
overrides, the phase and engine-kind vocabulary (``vocab``), and the Megatron-LM argument bridge
(``megatron_args``). A leaf: it imports nothing else of megatron_earl; start-up validation against
the components and the world size is ``orchestration.validate.validate_run``.

    from megatron_earl.config import load_config
    cfg = load_config("configs/demo_cpu.yaml", ["train.lr=1e-4"])
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
from megatron_earl.config.vocab import PHASES, EngineKind, Phase

__all__ = [
    "PHASES",
    "BatchConfig",
    "CheckpointConfig",
    "ConfigError",
    "EngineKind",
    "EnvConfig",
    "EvalConfig",
    "LayoutsConfig",
    "LoggingConfig",
    "ModelConfig",
    "ModelConfigError",
    "Phase",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SelectorSettings",
    "TrainConfig",
    "config_from_tree",
    "config_to_tree",
    "dump_config",
    "load_config",
    "save_config",
]
