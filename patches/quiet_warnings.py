"""Quiet runs: hide exactly the Megatron-Core warnings that say nothing on this machine.

What: two sets of ``warnings`` filters, each matching one message from one Megatron-Core module.
  * ``filter_import_warnings()`` (called by ``megatron_earl/__init__.py``, before megatron-core is
    imported): the fallbacks megatron-core announces at import when Transformer Engine / Apex are
    absent, torch's ``torch.jit.script_method`` deprecation raised by megatron-core's import-time
    code, and ``TransformerConfig``'s "full scope is deprecated" notice (a CUDA-graph scope).
  * ``apply()`` (on a machine without CUDA only): "... recommended to set the environment variable
    CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", which
    ``linear_with_grad_accumulation_and_async_allreduce`` emits on the first forward of a
    tensor-parallel linear in every process (so once per rank of every run with TP > 1).
Why: the import messages describe the expected CPU configuration (torch fallbacks, always taken
  without TE/Apex). CUDA_DEVICE_MAX_CONNECTIONS orders CUDA kernel launches so that TP
  communication overlaps compute on a GPU; on CPU there are no CUDA streams, so the advice is
  irrelevant. On a CUDA machine the CUDA_DEVICE_MAX_CONNECTIONS warning stays: there it is advice
  worth reading. Filtering (rather than setting the variable) changes no behaviour: the variable is
  also read by megatron-core's UCC-backend check.
Versions: megatron-core>=0.16.0,<0.17.0 (messages and warning module as in 0.16.1).
Test: tests/unit/test_patches.py (test_cpu_warning_filter_hides_only_the_cuda_connections_advice)
"""

from __future__ import annotations

import warnings

from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
TARGETS = (
    Target(
        "megatron.core.tensor_parallel.layers", "linear_with_grad_accumulation_and_async_allreduce"
    ),
)

IMPORT_MESSAGES = (
    ".*Transformer Engine and Apex are not installed",
    ".*Apex is not installed",
    ".*full scope is deprecated",
    ".*`torch.jit.script_method` is deprecated",
)
"""Messages of a CPU machine's expected set-up (no Transformer Engine, Apex or CUDA graphs)."""

CUDA_CONNECTIONS_MESSAGE = ".*CUDA_DEVICE_MAX_CONNECTIONS"
CUDA_CONNECTIONS_MODULE = "megatron.core.tensor_parallel.layers"


def filter_import_warnings() -> None:
    """Hide the import-time messages (must run before megatron-core is imported). Local."""
    for message in IMPORT_MESSAGES:
        warnings.filterwarnings("ignore", message=message)


def apply() -> bool:
    """On a machine without CUDA, hide the CUDA_DEVICE_MAX_CONNECTIONS advice; True when the
    filter is installed. Idempotent (``filterwarnings`` does not add a filter twice). Local."""
    import torch

    check_targets(__name__, VERSIONS, TARGETS)
    if torch.cuda.is_available():
        return False
    warnings.filterwarnings(
        "ignore",
        message=CUDA_CONNECTIONS_MESSAGE,
        category=UserWarning,
        module=CUDA_CONNECTIONS_MODULE,
    )
    return True
