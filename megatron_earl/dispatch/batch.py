"""Variable-length RL batches as the dispatcher sees them: packed samples, named fields, no padding.

A ``Batch`` is what one rank holds: ``n`` samples, each with a global ``sample_id`` (unique in the
step), a ``group_id`` (the prompt it belongs to; GRPO/RLOO groups) and a length in tokens.
Fields are named tensors of any dtype:

- per-token fields (tokens, loss masks, rollout/old/ref log-probs, ...) are packed along dim 0:
  shape ``[sum(lengths), *trailing]``; sample ``i`` occupies rows ``offsets[i]:offsets[i+1]``;
- per-sample fields (rewards, advantages, policy versions, ...) have shape ``[n, *trailing]``.

Nothing is padded to the batch maximum, so nothing padded goes on the wire. ``FieldSpec`` describes
a field (dtype, per-token or per-sample, trailing shape, the value used where a receiver pads for
context parallelism); a batch's ``schema`` is the sorted tuple of its specs and must be the same on
every rank of a dispatch (an empty rank still knows its schema).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


class BatchError(ValueError):
    """A batch whose fields, lengths or ids do not fit together; the message names the values."""


@dataclass(frozen=True)
class FieldSpec:
    """One named field of a batch."""

    name: str
    """Field name, e.g. "tokens", "loss_mask", "old_logprobs", "advantages"."""
    dtype: torch.dtype
    """Element dtype (any torch dtype; bool travels as one byte)."""
    per_token: bool
    """True: one row per token (packed along dim 0); False: one row per sample."""
    trailing: tuple[int, ...] = ()
    """Shape of one row (``()`` for a scalar per token / per sample)."""
    pad_value: float = 0
    """Value a receiver writes into context-parallel padding positions (never sent)."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise BatchError(f"field name must be a non-empty string, got {self.name!r}")
        if any(not isinstance(d, int) or d < 0 for d in self.trailing):
            raise BatchError(
                f"field {self.name!r}: trailing shape {self.trailing} must be ints >= 0"
            )

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one token or one sample)."""
        return _element_size(self.dtype) * math.prod(self.trailing)


Schema = tuple[FieldSpec, ...]
"""Field specs sorted by name."""


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


class Batch:
    """Samples held by one rank, packed (see the module docstring)."""

    def __init__(
        self,
        sample_ids: Sequence[int] | torch.Tensor,
        lengths: Sequence[int] | torch.Tensor,
        token_fields: Mapping[str, torch.Tensor],
        sample_fields: Mapping[str, torch.Tensor] | None = None,
        group_ids: Sequence[int] | torch.Tensor | None = None,
        pad_values: Mapping[str, float] | None = None,
    ) -> None:
        self.sample_ids = [int(s) for s in sample_ids]
        self.lengths = [int(n) for n in lengths]
        self.group_ids = list(self.sample_ids) if group_ids is None else [int(g) for g in group_ids]
        self.token_fields = dict(token_fields)
        self.sample_fields = dict(sample_fields or {})
        self.pad_values = dict(pad_values or {})
        self._check()
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)

    def _check(self) -> None:
        n = len(self.sample_ids)
        if len(self.lengths) != n or len(self.group_ids) != n:
            raise BatchError(
                f"{n} sample_ids but {len(self.lengths)} lengths and {len(self.group_ids)} "
                "group_ids; give one of each per sample"
            )
        if len(set(self.sample_ids)) != n:
            dup = sorted({s for s in self.sample_ids if self.sample_ids.count(s) > 1})
            raise BatchError(f"duplicate sample_ids {dup[:8]} in one batch; ids must be unique")
        bad = [(s, n) for s, n in zip(self.sample_ids, self.lengths) if n < 1]
        if bad:
            raise BatchError(f"(sample_id, length) {bad[:8]}: every sample needs length >= 1")
        both = set(self.token_fields) & set(self.sample_fields)
        if both:
            raise BatchError(f"fields {sorted(both)} are both per-token and per-sample")
        unknown = set(self.pad_values) - set(self.token_fields)
        if unknown:
            raise BatchError(f"pad_values for {sorted(unknown)}, which are not per-token fields")
        total = sum(self.lengths)
        for kind, fields, rows in (
            ("per-token", self.token_fields, total),
            ("per-sample", self.sample_fields, n),
        ):
            for name, t in fields.items():
                if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != rows:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise BatchError(
                        f"{kind} field {name!r} has shape {shape}; expected dim 0 = {rows} "
                        f"({'sum of lengths' if kind == 'per-token' else 'number of samples'} "
                        f"{self.lengths if len(self.lengths) <= 8 else ''})"
                    )

    # ------------------------------------------------------------------ views

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def schema(self) -> Schema:
        specs = [
            FieldSpec(k, t.dtype, True, tuple(t.shape[1:]), self.pad_values.get(k, 0))
            for k, t in self.token_fields.items()
        ]
        specs += [
            FieldSpec(k, t.dtype, False, tuple(t.shape[1:])) for k, t in self.sample_fields.items()
        ]
        return tuple(sorted(specs, key=lambda s: s.name))

    def index(self, sample_id: int) -> int:
        return self.sample_ids.index(sample_id)

    def sample(self, sample_id: int) -> dict[str, torch.Tensor]:
        """All fields of one sample (views): per-token ``[length, ...]``, per-sample ``[...]``."""
        i = self.index(sample_id)
        a, b = self.offsets[i], self.offsets[i + 1]
        out = {k: t[a:b] for k, t in self.token_fields.items()}
        out.update({k: t[i] for k, t in self.sample_fields.items()})
        return out

    def select(self, sample_ids: Sequence[int]) -> Batch:
        """The batch of the samples ``sample_ids`` (a subset, in that order; ids, groups,
        lengths and every field kept); ``self`` when that is every sample in its order."""
        sample_ids = [int(s) for s in sample_ids]
        if sample_ids == self.sample_ids:
            return self
        position = {s: i for i, s in enumerate(self.sample_ids)}
        unknown = [s for s in sample_ids if s not in position]
        if unknown:
            raise BatchError(f"sample_ids {unknown[:8]} are not in this batch ({self!r})")
        rows = [position[s] for s in sample_ids]
        spans = [torch.arange(self.offsets[i], self.offsets[i + 1]) for i in rows]
        # row indices built on the host, moved to each field's device (a no-op on the host)
        token_rows = torch.cat(spans) if spans else torch.empty(0, dtype=torch.long)
        sample_rows = torch.tensor(rows, dtype=torch.long)
        return Batch(
            sample_ids,
            [self.lengths[i] for i in rows],
            {k: t.index_select(0, token_rows.to(t.device)) for k, t in self.token_fields.items()},
            {k: t.index_select(0, sample_rows.to(t.device)) for k, t in self.sample_fields.items()},
            group_ids=[self.group_ids[i] for i in rows],
            pad_values=self.pad_values,
        )

    @classmethod
    def from_samples(
        cls,
        samples: Sequence[Mapping[str, torch.Tensor]],
        sample_ids: Sequence[int],
        schema: Schema,
        group_ids: Sequence[int] | None = None,
    ) -> Batch:
        """Pack per-sample dicts (per-token fields ``[len, ...]``, per-sample ``[...]``).

        ``schema`` gives the fields (and dtypes of an empty batch)."""
        token_fields, sample_fields = {}, {}
        lengths = []
        token_specs = [s for s in schema if s.per_token]
        for i, smp in enumerate(samples):
            lens = {s.name: smp[s.name].shape[0] for s in token_specs}
            if len(set(lens.values())) > 1:
                raise BatchError(
                    f"sample {sample_ids[i]}: per-token fields have different lengths {lens}"
                )
            lengths.append(next(iter(lens.values())) if lens else 1)
        for s in schema:
            rows = [
                smp[s.name].reshape(-1, *s.trailing)
                if s.per_token
                else smp[s.name].reshape(1, *s.trailing)
                for smp in samples
            ]
            t = torch.cat(rows) if rows else torch.empty((0, *s.trailing), dtype=s.dtype)
            (token_fields if s.per_token else sample_fields)[s.name] = t.to(s.dtype)
        pads = {s.name: s.pad_value for s in token_specs if s.pad_value != 0}
        return cls(sample_ids, lengths, token_fields, sample_fields, group_ids, pads)

    @classmethod
    def empty(cls, schema: Schema) -> Batch:
        """A batch with no samples (a rank that produced nothing this step)."""
        return cls.from_samples([], [], schema)

    def __repr__(self) -> str:
        return (
            f"Batch({self.num_samples} samples, {self.num_tokens} tokens, "
            f"fields={[s.name for s in self.schema]})"
        )


def batches_equal(a: Batch, b: Batch) -> bool:
    """Bitwise equality of ids, lengths, groups and every field (same dtype and bytes)."""
    if (a.sample_ids, a.lengths, a.group_ids, a.schema) != (
        b.sample_ids,
        b.lengths,
        b.group_ids,
        b.schema,
    ):
        return False
    fields = [(a.token_fields, b.token_fields), (a.sample_fields, b.sample_fields)]
    return all(tensors_equal(x[k], y[k]) for x, y in fields for k in x)


def tensors_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs compare equal to themselves bitwise)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(_bytes(x), _bytes(y))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8)
