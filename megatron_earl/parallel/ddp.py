"""The model inside a Megatron DDP wrapper: the one unwrap helper.

Policy chunks are ``DistributedDataParallel(GPTModel)`` in the train layout and bare ``GPTModel``s
in the other layouts; code that needs the model's own methods (``sharded_state_dict``, its config,
the output layer) calls ``unwrap_chunk`` whatever it was given.
"""

from __future__ import annotations

from torch import nn


def unwrap_chunk(chunk: nn.Module) -> nn.Module:
    """The model inside ``chunk`` (every ``.module`` wrapper removed; ``chunk`` itself when it
    is not wrapped)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
