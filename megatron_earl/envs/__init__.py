"""Environments for agentic rollouts: the async gym-like API, its registry (``ENVS``) and the
built-in tasks: ``arithmetic`` (calculator tool), ``guessing`` (multi-turn higher/lower game),
``python_sum`` (sandboxed python tool), ``longtail`` (long-tailed turn counts, for benchmarks).
``ENVS.build("arithmetic")``, ``ENVS.build({"name": "guessing", "kwargs": {"difficulty": 4}})``,
``ENVS.build("x.yaml")`` or a dotted path ``"my_pkg.envs:MyEnv"``."""

from __future__ import annotations

from megatron_earl.envs.arithmetic import ArithmeticEnv
from megatron_earl.envs.base import (
    ENVS,
    Action,
    Environment,
    ResetResult,
    StepResult,
    check_reset_result,
    check_step_result,
)
from megatron_earl.envs.guessing import GuessingEnv
from megatron_earl.envs.longtail import LongTailEnv
from megatron_earl.envs.python_task import PythonSumEnv
from megatron_earl.envs.tool_env import ToolEnv

__all__ = [
    "ENVS",
    "Action",
    "ArithmeticEnv",
    "Environment",
    "GuessingEnv",
    "LongTailEnv",
    "PythonSumEnv",
    "ResetResult",
    "StepResult",
    "ToolEnv",
    "check_reset_result",
    "check_step_result",
]
