"""The embedded engine's KV cache: Megatron's ``StaticInferenceContext`` with request slots.

Megatron's static context keeps one KV buffer per layer, ``[max_seq, max_batch, ng/tp, hn]``, and
a single write offset (``sequence_len_offset``) shared by the whole batch; its attention writes the
new keys/values at that offset for rows ``[batch_size_offset, batch_size_offset + b)`` and attends
over ``[0, offset + s)``. Rotary embeddings are applied to queries at ``[offset, offset + s)``
and to the cached (un-rotated) keys at ``[0, offset + s)`` on every step.

To batch requests of different lengths that join and leave at any step (continuous batching at
request granularity), the slots are *right-aligned at a common cursor* ``T``: row ``i`` holds its
``n_i`` tokens at time positions ``[T - n_i, T)``; the rest of its column is masked out by an
explicit attention mask (``SDPAttention`` honours it). RoPE scores depend only on the relative
position of query and key, so a row shifted by ``T - n_i`` computes the same attention as one
starting at position 0 (up to float rounding of the rotary tables). Keys are cached un-rotated, so
moving the time axis is a plain copy:

* a prompt longer than ``T`` shifts every row right (``T`` grows to the prompt length);
* when ``T`` reaches ``max_seq``, rows shift left by the free space of the fullest row;
* a finished row is replaced by the last active row (column copy), so active rows are always the
  contiguous range ``[0, n)`` Megatron's static path expects.

The buffers are allocated here (Megatron's lazy allocation asks ``torch.cuda.current_device()``).
``plan_*`` functions are pure; ``SlotCache`` applies them to the tensors. No communication.
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts.static_context import StaticInferenceContext
from torch import nn


def plan_admit(cursor: int, prompt_len: int, max_seq: int) -> int:
    """Right shift needed before a prompt of ``prompt_len`` tokens can end at the cursor."""
    if not 1 <= prompt_len <= max_seq:
        raise ValueError(f"prompt length {prompt_len} must be in [1, max_seq={max_seq}]")
    return max(0, prompt_len - cursor)


def plan_compaction(cursor: int, lengths: list[int], max_seq: int) -> int:
    """Left shift needed before a decode step so position ``cursor`` exists (0 if it does)."""
    if cursor < max_seq:
        return 0
    longest = max(lengths, default=0)
    if longest >= max_seq:
        raise ValueError(f"a row of {longest} tokens cannot grow within max_seq={max_seq}")
    return cursor - longest


def prefill_mask(cursor: int, prompt_len: int) -> torch.Tensor:
    """Megatron-style mask (True = blocked) [1, 1, L, cursor] for a prompt ending at ``cursor``."""
    start = cursor - prompt_len
    q_pos = torch.arange(start, cursor)[:, None]
    k_pos = torch.arange(cursor)[None, :]
    allowed = (k_pos >= start) & (k_pos <= q_pos)
    return (~allowed)[None, None]


def decode_mask(cursor: int, lengths: list[int]) -> torch.Tensor:
    """Mask (True = blocked) [n, 1, 1, cursor + 1] for one new token per row at ``cursor``."""
    first = cursor - torch.tensor(lengths)[:, None]
    k_pos = torch.arange(cursor + 1)[None, :]
    return (k_pos < first)[:, None, None, :]


class SlotCache(StaticInferenceContext):
    """Static inference context whose rows are request slots right-aligned at a cursor."""

    def __init__(self, model: nn.Module, max_batch_size: int, max_seq_len: int) -> None:
        super().__init__(max_batch_size, max_seq_len)
        layers = [
            m for m in model.modules() if hasattr(m, "linear_qkv") and hasattr(m, "layer_number")
        ]
        if not layers:
            raise ValueError("model has no attention layers with a KV cache")
        for attn in layers:
            shape = (max_seq_len, max_batch_size, attn.num_query_groups_per_partition)
            weight = attn.linear_qkv.weight
            # On the weights' device (the compute device): the cache is read by every decode step.
            keys = torch.zeros(
                *shape, attn.key_hidden_size, dtype=weight.dtype, device=weight.device
            )
            values = torch.zeros(
                *shape, attn.val_hidden_size, dtype=weight.dtype, device=weight.device
            )
            self.key_value_memory_dict[attn.layer_number] = (keys, values)

    def buffers(self) -> list[torch.Tensor]:
        return [t for pair in self.key_value_memory_dict.values() for t in pair]

    def shift(self, delta: int, cursor: int) -> None:
        """Move positions ``[0, cursor)`` by ``delta`` (> 0 right, < 0 left) for every row."""
        if delta == 0 or cursor == 0:
            return
        for buf in self.buffers():
            if delta > 0:
                buf[delta : delta + cursor] = buf[:cursor].clone()
            else:
                buf[: cursor + delta] = buf[-delta:cursor].clone()

    def move_row(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into slot ``dst`` (every layer, every position)."""
        for buf in self.buffers():
            buf[:, dst] = buf[:, src]

    def for_prefill(self, row: int, cursor: int, prompt_len: int) -> None:
        self.batch_size_offset = row
        self.sequence_len_offset = cursor - prompt_len
        self.enable_prefill_mode()

    def for_decode(self, cursor: int) -> None:
        self.batch_size_offset = 0
        self.sequence_len_offset = cursor
        self.enable_decode_mode()
