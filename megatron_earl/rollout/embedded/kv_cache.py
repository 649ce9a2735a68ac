"""The embedded engine's KV cache: one slot (row) per running request, keys stored rotated.

Per attention layer two buffers ``[max_batch_size, ng, max_seq_len, hn]`` (legend: ng = query
groups on this TP rank, hn = head dim), allocated on the weights' device (the compute device:
every step reads them) and bounded for the engine's lifetime: ``max_batch_size`` requests of up
to ``max_seq_len`` tokens, as many rows as a memory budget holds (``config.embedded.
kv_cache_rows``, sized by ``BatchedForward``; requests beyond them wait for a row). Dropped and
allocated again, empty, by SGLang's memory release and resume for colocation
(``RowCache.release`` / ``allocate``). Row ``r`` holds its request's keys
and values at their true positions ``[0, length_r)``; keys are stored *after* RoPE, so a decode
step rotates only the new token's key (Megatron's static inference context caches un-rotated
keys and rotates the whole cache on every step). Rows of running requests are always the
contiguous range ``[0, n)``: a finished row is refilled by the last row (``plan_free``), so a
step reads a view, never a gather.

Finished requests with a session may *park* their row (``RowTable``): the next turn of that
session -- whose context extends the parked tokens -- takes the row over and prefills only its
new tokens (SGLang's prefix cache, per session); parked rows are evicted oldest first when rows
run out, and all are dropped when the weights change. ``plan_free`` and ``RowTable`` are pure
bookkeeping that emits ordered row moves; ``RowCache`` applies them to the tensors. No
communication.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Generic, TypeVar

import torch

from megatron_earl.device_policy import to_host

T = TypeVar("T")


def plan_free(num_rows: int, row: int) -> tuple[int, int] | None:
    """The move (src, dst) that keeps rows ``[0, num_rows - 1)`` contiguous when ``row`` is freed
    (the last row takes its place), or None when ``row`` is the last one."""
    if not 0 <= row < num_rows:
        raise ValueError(f"row {row} is not a running row of [0, {num_rows})")
    last = num_rows - 1
    return None if row == last else (last, row)


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
        routes: tuple[int, int] | None = None,
    ) -> None:
        """``routes``: (MoE layers, top-k) -- also keep each position's routed experts, a
        buffer ``[max_batch_size, max_seq_len, layers, topk]`` (int16) moved, released and
        allocated with the keys and values (routing replay: a request's routes cover its cached
        prefix too, as SGLang's ``return_routed_experts`` does)."""
        self.shape = (max_batch_size, num_groups, max_seq_len, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.routes_shape = None if routes is None else (max_batch_size, max_seq_len, *routes)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.routes: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def row_bytes(
        num_layers: int,
        num_groups: int,
        head_dim: int,
        length: int,
        dtype: torch.dtype,
        routes: tuple[int, int] | None = None,
    ) -> int:
        """Bytes of one row of ``length`` positions over every layer (keys and values, and the
        int16 routes of ``routes`` = (MoE layers, topk): not split over TP like the keys)."""
        element = torch.empty((), dtype=dtype).element_size()
        kv = num_layers * 2 * num_groups * length * head_dim * element
        return kv + (0 if routes is None else length * routes[0] * routes[1] * 2)

    def allocate(self) -> None:
        """(Re)create the buffers, zeroed (at start-up and when a released cache is resumed)."""
        self.keys = [self._zeros() for _ in range(self.num_layers)]
        self.values = [self._zeros() for _ in range(self.num_layers)]
        if self.routes_shape is not None:
            self.routes = torch.zeros(self.routes_shape, dtype=torch.int16, device=self.device)

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Drop the buffers (``release_memory_occupation`` of ``kv_cache``): their memory is
        freed once no step holds a view of them; ``allocate`` brings them back, empty of any
        cached tokens. No forward may run in between."""
        self.keys, self.values, self.routes = [], [], None

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def buffers(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values, *([] if self.routes is None else [self.routes])]

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

    def gather(self, layer: int, rows: torch.Tensor, length: int):
        """Keys and values ``[len(rows), ng, length, hn]`` of the given rows (a copy)."""
        keys, values = self.keys[layer][:, :, :length], self.values[layer][:, :, :length]
        return keys.index_select(0, rows), values.index_select(0, rows)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (every layer)."""
        for buf in [*self.keys, *self.values]:
            buf[dst, :, :length] = buf[src, :, :length]
        if self.routes is not None:
            self.routes[dst, :length] = self.routes[src, :length]

    def write_routes(
        self, rows_W: torch.Tensor, pos_W: torch.Tensor, routes_WLk: torch.Tensor
    ) -> None:
        """Store the routed experts ``[W, L, k]`` of the positions written at (row, pos)."""
        self.routes[rows_W, pos_W] = routes_WLk.to(torch.int16)

    def read_routes(self, spans: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Routed experts of each (row, start, end): ``[end - start, L, k]`` int32 on the host,
        read in one device -> host transfer (boundary "finished requests' routes",
        docs/devices.md)."""
        if not spans:
            return []
        parts = torch.cat([self.routes[row, start:end] for row, start, end in spans])
        host = to_host(parts).to(torch.int32)  # a copy: the rows change after
        return list(host.split([end - start for _, start, end in spans]))


class RowTable(Generic[T]):
    """Which cache row holds what (pure bookkeeping; ``RowCache`` applies ``take_moves()``).

    Running rows are ``[0, n)``, in ``items`` order with their cached ``lengths``. A finished
    request's row may be *parked* under its session (the cached tokens kept, for the session's
    next turn, whose context extends them): parked rows sit at the top, ``[M - p, M)``, least
    recently parked first to be evicted. Every change of place is an ordered move
    ``(src, dst, length)``; moves are applied in order before the next forward.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.items: list[T] = []
        self.lengths: list[int] = []
        self.parked: OrderedDict[str, tuple[int, tuple[int, ...]]] = OrderedDict()
        """session -> (row, cached tokens), least recently parked first."""
        self._moves: list[tuple[int, int, int]] = []

    @property
    def free_rows(self) -> int:
        return self.num_rows - len(self.items) - len(self.parked)

    def take_moves(self) -> tuple[tuple[int, int, int], ...]:
        moves, self._moves = tuple(self._moves), []
        return moves

    def _move(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            self._moves.append((src, dst, length))

    def reusable(self, session: str | None, context: Sequence[int]) -> int:
        """Tokens of ``context`` a parked row of ``session`` already caches (0 if none)."""
        if session is None or session not in self.parked:
            return 0
        cached = self.parked[session][1]
        ok = len(cached) < len(context) and tuple(context[: len(cached)]) == cached
        return len(cached) if ok else 0

    def evict(self, keep: Collection[str] = ()) -> bool:
        """Drop the least recently parked row not in ``keep``; False if there is none."""
        for session in self.parked:
            if session not in keep:
                self._unpark(session)
                return True
        return False

    def _unpark(self, session: str) -> tuple[int, tuple[int, ...]]:
        """Forget ``session``'s parked row; the lowest parked row fills its place."""
        row, cached = self.parked.pop(session)
        lowest = self.num_rows - len(self.parked) - 1
        if row != lowest:
            other = next(s for s, (r, _) in self.parked.items() if r == lowest)
            self._move(lowest, row, len(self.parked[other][1]))
            self.parked[other] = (row, self.parked[other][1])
        return row, cached

    def can_add(self, session: str | None = None) -> bool:
        """Whether ``add`` has a row for a new running request (``session``: one that takes
        over that session's parked row)."""
        if self.free_rows > 0:
            return True
        return session in self.parked and self.parked[session][0] == len(self.items)

    def add(self, item: T, length: int, session: str | None = None) -> int:
        """A running row for ``item`` (``can_add`` must hold); with ``session`` parked, its
        row's cache comes along (the caller prefills only the rest, ``reusable``). Returns the
        row."""
        if not self.can_add(session):
            raise ValueError(f"all {self.num_rows} rows are taken; evict first")
        row = len(self.items)
        if session is not None and session in self.parked:
            parked_row, cached = self.parked[session]
            self._move(parked_row, row, len(cached))
            self._unpark(session)
        self.items.append(item)
        self.lengths.append(length)
        return row

    def forget(self, session: str | None) -> None:
        """Drop ``session``'s parked row, if any (its context did not extend it)."""
        if session in self.parked:
            self._unpark(session)

    def release(self, row: int, park: tuple[str, tuple[int, ...]] | None = None) -> None:
        """Release running ``row`` (rows must be released in descending order within one
        step); ``park=(session, cached tokens)`` keeps its cache for the session's next turn
        when a row is free for it (after evicting older parked rows if needed)."""
        if park is not None:
            session, cached = park
            if session in self.parked:
                self._unpark(session)
            if self.free_rows == 0:
                self.evict()
            if self.free_rows > 0:
                slot = self.num_rows - len(self.parked) - 1
                self._move(row, slot, len(cached))
                self.parked[session] = (slot, tuple(cached))
        move = plan_free(len(self.items), row)
        if move is not None:
            src, dst = move
            self.items[dst], self.lengths[dst] = self.items[src], self.lengths[src]
            self._move(src, dst, self.lengths[src])
        self.items.pop()
        self.lengths.pop()

    def drop_parked(self) -> None:
        """Forget every parked row (the weights changed: their keys and values are stale)."""
        self.parked.clear()
