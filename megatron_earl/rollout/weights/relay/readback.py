"""What a relay reads back from an engine after a load, and when the engine's answer matches
what was published (pure: no I/O).

    buckets = sampled_buckets(num_buckets=12, num_tensors=4)     # {0, 4, 7, 11}
    want = smallest_tensor_of_the_bucket[:VERIFY_ROWS]            # the published first rows
    got = await client.get_weights_by_name(name, len(want))       # SGLang's answer (float32 lists)
    read_back_matches(got, want)                                  # exact, see below

A checksum proves what a relay holds; only a read-back proves what an engine holds after a load
(a load can fail silently: a wrong layout, a bug in a weight loader, a second writer). SGLang's
``get_weights_by_name`` answers ``tensor.float().tolist()[:truncate_size]``: the first rows of a
matrix, the first entries of a vector. With TP > 1 SGLang answers TP rank 0's shard for the
column-parallel tensors, whose first rows are the full tensor's first rows as long as
``truncate_size`` rows fit in one shard, so only a few rows (``VERIFY_ROWS``) are asked for.
SGLang 0.5.23 truncates only after turning the whole tensor into a Python list, so a read-back of
an embedding of 150k x 8192 would cost the engine minutes and tens of GB: the relay reads back the
smallest tensor of each sampled bucket (a norm's weights, typically). A sample: a tensor outside
it that a load got wrong is not seen.
"""

from __future__ import annotations

from typing import Any

import torch

VERIFY_ROWS = 2
"""Rows (of a matrix; entries of a vector) of each sampled tensor read back."""
SGLANG_NO_EXPORT = "Get parameter by name failed"
"""SGLang's 400 message when the model cannot export a tensor (Qwen2/Qwen3 models in 0.5.23 have
no ``get_weights_by_name``): the read-back is unsupported there, not a mismatch."""


def sampled_buckets(num_buckets: int, num_tensors: int) -> set[int]:
    """Indices of the ``num_tensors`` buckets (at most all of them) whose first tensor is read
    back: spread evenly over the version, the first and the last bucket included."""
    if num_tensors <= 0 or num_buckets <= 0:
        return set()
    if num_tensors >= num_buckets:
        return set(range(num_buckets))
    if num_tensors == 1:
        return {0}
    return {round(j * (num_buckets - 1) / (num_tensors - 1)) for j in range(num_tensors)}


def read_back_matches(got: Any, want: torch.Tensor) -> bool:
    """Whether ``get_weights_by_name``'s answer ``got`` holds the published values ``want``:
    exactly, compared in float32 (SGLang's answer type, which holds bfloat16, float16 and float32
    values exactly). An engine that holds a lower precision than was published matches ``want``
    rounded to bfloat16 or float16. An answer of one list per DP rank (SGLang with data-parallel
    attention) must match on every rank."""
    try:
        answer = torch.tensor(got, dtype=torch.float32)
    except (TypeError, ValueError):  # not a (rectangular) list of numbers
        return False
    if answer.shape == want.shape:
        ranks = [answer]
    elif answer.dim() == want.dim() + 1 and answer.shape[1:] == want.shape:
        ranks = list(answer)
    else:
        return False
    candidates = [want.to(dtype).to(torch.float32) for dtype in (want.dtype, torch.bfloat16)]
    candidates.append(want.to(torch.float16).to(torch.float32))
    return all(any(torch.equal(rank, c) for c in candidates) for rank in ranks)
