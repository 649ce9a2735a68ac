"""The embedded engine's KV cache: one slot (row) per running request, keys stored rotated.

Per attention layer two buffers ``[max_batch_size, ng, max_seq_len, hn]`` (legend: ng = query
groups on this TP rank, hn = head dim), allocated on the weights' device (the compute device:
every step reads them) and bounded for the engine's lifetime: ``max_batch_size`` requests of up
to ``max_seq_len`` tokens. Row ``r`` holds its request's keys and values at their true positions
``[0, length_r)``; keys are stored *after* RoPE, so a decode step rotates only the new token's
key (Megatron's static inference context caches un-rotated keys and rotates the whole cache on
every step). Rows of running requests are always the contiguous range ``[0, n)``: a finished
row is refilled by the last row (``plan_free``), so a step reads a view, never a gather.

``plan_*`` functions are pure; ``RowCache`` applies them to the tensors. No communication.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def plan_free(num_rows: int, row: int) -> tuple[int, int] | None:
    """The move (src, dst) that keeps rows ``[0, num_rows - 1)`` contiguous when ``row`` is freed
    (the last row takes its place), or None when ``row`` is the last one."""
    if not 0 <= row < num_rows:
        raise ValueError(f"row {row} is not a running row of [0, {num_rows})")
    last = num_rows - 1
    return None if row == last else (last, row)


def plan_admit(
    waiting_lengths: Sequence[int], free_rows: int, max_prefill_tokens: int, max_requests: int
) -> int:
    """How many of the waiting requests (FIFO, context lengths given) one prefill step admits:
    as many as fit in the free rows, at most ``max_requests``, their contexts summing to at most
    ``max_prefill_tokens`` -- but always the first one when a row is free (a context longer than
    the prefill budget is prefilled alone). The rest wait; none is refused."""
    count = tokens = 0
    for length in waiting_lengths[: min(free_rows, max_requests)]:
        if count and tokens + length > max_prefill_tokens:
            break
        count, tokens = count + 1, tokens + length
    return count


class RowCache:
    """Per-layer key/value buffers with one row per running request (module docstring)."""

    def __init__(
        self,
        num_layers: int,
        num_groups: int,
        head_dim: int,
        max_batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (max_batch_size, num_groups, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len

    def buffers(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def write(
        self, layer: int, rows_T: torch.Tensor, pos_T: torch.Tensor, k_T: torch.Tensor,
        v_T: torch.Tensor,
    ) -> None:  # fmt: skip
        """Store the step's new keys/values ``[T, ng, hn]`` of token t at (rows_T[t], pos_T[t])."""
        self.keys[layer][rows_T, :, pos_T] = k_T
        self.values[layer][rows_T, :, pos_T] = v_T

    def view(self, layer: int, row0: int, count: int, length: int):
        """Keys and values ``[count, ng, length, hn]`` of rows ``[row0, row0 + count)``."""
        rows = slice(row0, row0 + count)
        return self.keys[layer][rows, :, :length], self.values[layer][rows, :, :length]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (every layer)."""
        for buf in self.buffers():
            buf[dst, :, :length] = buf[src, :, :length]
