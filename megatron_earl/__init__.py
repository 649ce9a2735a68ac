"""megatron-earl: a Megatron-Core plugin for long-context agentic RL (EARL design)."""

__version__ = "0.1.0"
