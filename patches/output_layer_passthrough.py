"""Last-stage GPT chunks return final hidden states instead of logits, for the chunked log-probs.

What: ``passthrough(layers)`` (scoped) sets ``forward`` on each given output-layer instance (a
  ``ColumnParallelLinear``) to a function that returns its input, ``(input_, None)``, and
  deletes the instance attribute on exit, so the class's ``forward`` applies again. Parameters stay
  where they are, so DDP and the optimizer see no change. Under sequence parallelism the input
  holds 1/tp of the sequence; it is all-gathered over TP first, as the layer's own forward does
  (backward: this rank's slice of the gradient, which ``head_logprobs`` all-reduces over TP).
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


def _forward_for(layer: nn.Module):
    """The replacement forward of ``layer``: the identity, or the sequence-parallel all-gather."""
    if not getattr(layer, "sequence_parallel", False):
        return _passthrough
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    group = layer.tp_group

    def gathered(input_, weight=None, runtime_gather_output=None):
        whole = gather_from_sequence_parallel_region(
            input_, tensor_parallel_output_grad=False, group=group
        )
        return whole, None

    return gathered


@contextlib.contextmanager
def passthrough(layers: Sequence[nn.Module]) -> Iterator[None]:
    """While active, each of ``layers`` returns its input (the hidden states; the whole sequence
    under sequence parallelism). Collective over TP under sequence parallelism, else local."""
    for layer in layers:
        layer.forward = _forward_for(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
