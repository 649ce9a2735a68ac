"""Last-stage GPT chunks return final hidden states instead of logits, for the chunked log-probs.

What: ``passthrough(layers)`` (scoped) sets ``forward`` on each given output-layer instance (a
  ``ColumnParallelLinear``) to a function that returns its input unchanged, ``(input_, None)``, and
  deletes the instance attribute on exit, so the class's ``forward`` applies again. Parameters stay
  where they are, so DDP and the optimizer see no change.
Why: ``megatron_earl.training.logprobs.head_logprobs`` computes log-probs and entropy from the final
  hidden states with the output layer chunked over tokens, so full-vocabulary fp32 logits never
  exist for a whole packed row. ``GPTModel.forward`` has no option to skip its output layer.
Versions: megatron-core>=0.16.0,<0.17.0 (``GPTModel`` calls ``self.output_layer(hidden_states,
  weight=..., runtime_gather_output=...)`` and unpacks ``(logits, bias)``, as in 0.16.1).
Test: tests/distributed/test_logprobs.py (test_layouts_equal_single_process: log-probs through
  ``rl_step.forward_logprobs`` under TP/PP/CP equal a full-logits single-process reference)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn

from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
TARGETS = (
    Target("megatron.core.tensor_parallel.layers", "ColumnParallelLinear.forward"),
    Target("megatron.core.models.gpt.gpt_model", "GPTModel.forward"),
)


def apply() -> bool:
    """Check the targets (scoped patch: ``logprobs.output_hidden_states`` enters it). Local."""
    check_targets(__name__, VERSIONS, TARGETS)
    return False


def _passthrough(input_, weight=None, runtime_gather_output=None):
    return input_, None


@contextlib.contextmanager
def passthrough(layers: Sequence[nn.Module]) -> Iterator[None]:
    """While active, each of ``layers`` returns its input (the hidden states). Local."""
    for layer in layers:
        layer.forward = _passthrough
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
