"""The MoE router's gating GEMM runs without Transformer Engine.

What: when ``megatron.core.transformer.moe.moe_utils`` has no ``te_general_gemm`` (its
  ``try: import transformer_engine`` failed, so the name was never bound), bind it to None; the
  router's ``RouterGatingLinearFunction`` then takes its own ``torch.mm`` branch, as the code
  intends when TE is absent. Nothing changes where Transformer Engine is installed.
Why: ``RouterGatingLinearFunction.forward/backward`` test ``te_general_gemm is not None``, but the
  module only binds the name inside its TE import: without TE every MoE forward raised
  ``NameError: name 'te_general_gemm' is not defined``.
Versions: megatron-core>=0.16.0,<0.17.0 (observed with megatron-core 0.16.1 on a CPU-only
  torch build without transformer_engine).
Test: tests/distributed/test_moe.py (test_moe_model_trains_at_ep1_and_ep2)
"""

from __future__ import annotations

import importlib

from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
TARGETS = (Target("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction"),)


def apply() -> bool:
    """Bind ``moe_utils.te_general_gemm = None`` unless TE bound it; True when the name is this
    patch's (None). Idempotent. Local."""
    check_targets(__name__, VERSIONS, TARGETS)
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if getattr(moe_utils, "te_general_gemm", None) is not None:
        return False  # Transformer Engine's GEMM
    moe_utils.te_general_gemm = None
    return True
