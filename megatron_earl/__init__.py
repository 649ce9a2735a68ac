"""megatron-earl: a Megatron-Core plugin for long-context agentic RL (EARL design)."""

import warnings as _warnings

__version__ = "0.1.0"

# megatron-core announces, at import, every torch fallback it takes when Transformer Engine / Apex
# are absent (always the case on CPU machines). They are expected; hide exactly those messages.
for _message in (
    ".*Transformer Engine and Apex are not installed",
    ".*Apex is not installed",
    ".*full scope is deprecated",
    ".*`torch.jit.script_method` is deprecated",
):
    _warnings.filterwarnings("ignore", message=_message)
