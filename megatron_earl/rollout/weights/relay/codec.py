"""A bucket of named tensors as bytes, the unit relays store, checksum and forward.

    data = encode_bucket([("model.embed_tokens.weight", t), ...])   # safetensors bytes
    named = decode_bucket(data)                                      # [(name, tensor), ...]

safetensors, not pickle: a relay (or an engine's relay) decodes bytes that came over the
network, and safetensors holds only names, dtypes, shapes and raw data, so decoding runs no code.
The order of the tensors is kept (a ``__order__`` metadata entry), so an engine receives them in
the order the trainer published them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

NamedTensor = tuple[str, torch.Tensor]
_ORDER = "__order__"


def encode_bucket(bucket: Sequence[NamedTensor]) -> bytes:
    """safetensors bytes of ``bucket`` (host copies of contiguous tensors)."""
    names = [name for name, _ in bucket]
    if len(set(names)) != len(names):
        raise ValueError(
            f"a bucket names a tensor twice: {sorted(n for n in names if names.count(n) > 1)}"
        )
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in bucket}
    return st_save(tensors, metadata={_ORDER: json.dumps(names)})


def decode_bucket(data: bytes) -> list[NamedTensor]:
    """The named tensors of ``encode_bucket``'s bytes, in their published order."""
    tensors = st_load(data)
    header_len = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    order = json.loads(metadata.get(_ORDER, "null")) or sorted(tensors)
    if sorted(order) != sorted(tensors):
        raise ValueError("bucket order metadata does not list its tensors")
    return [(name, tensors[name]) for name in order]
