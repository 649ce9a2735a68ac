"""A network model that projects a plan's transfer stages onto a GPU cluster (pure).

Cluster: ``gpus_per_node`` consecutive ranks per node. Inside a node every GPU has its own NVLink
bandwidth per direction; between nodes every node has one NIC bandwidth per direction, shared by
its GPUs. A stage takes as long as its busiest link (bandwidth-bound: the largest of every GPU's
NVLink bytes out/in and every node's NIC bytes out/in, each over its bandwidth) plus a per-message
latency times the largest number of messages one rank sends or receives. Stages run one after the
other. Local copies (src == dst) are free.

The model ignores congestion inside the fabric and overlap between stages; it is applied to the
decentralized and the centralized stages of the same plan, so what it compares is the routing.

Optional terms describe a host rather than a GPU cluster (the local benchmark calibrates them,
``bench.calibrate``): ``aggregate_gbps`` caps what all ranks move together (processes sharing a
few CPU cores), ``copy_gbps`` and ``slice_us`` charge each rank's packing and assembling, shared
over ``cores``. ``all_gather_seconds`` models the metadata all-gather (recursive doubling).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from megatron_earl.dispatch.batch import Schema
from megatron_earl.dispatch.route import DispatchError, Piece, Transfer


@dataclass(frozen=True)
class NetworkModel:
    """Link parameters (defaults: an H100 node with one 400 Gb/s NIC)."""

    gpus_per_node: int = 8
    """Ranks per node."""
    nvlink_gbps: float = 450.0
    """NVLink GB/s per GPU per direction (NVLink 4: 900 GB/s bidirectional)."""
    nic_gbps: float = 50.0
    """Inter-node GB/s per node per direction (one 400 Gb/s NIC)."""
    latency_us: float = 10.0
    """Per-message start-up cost, microseconds."""
    aggregate_gbps: float | None = None
    """GB/s all ranks move together in one stage (a shared host); None: no such cap."""
    copy_gbps: float | None = None
    """GB/s one rank copies (packing what it sends, assembling what it needs); None: copies
    are free (GPU copies run far faster than the links)."""
    slice_us: float | None = None
    """CPU microseconds per field slice a rank packs or unpacks (the executor's per-slice
    overhead); None: free."""
    cores: int | None = None
    """Cores the ranks share for that work (a host); None: one per rank."""

    def __post_init__(self) -> None:
        bad = {k: v for k, v in asdict(self).items() if v is not None and v <= 0}
        if bad:
            raise DispatchError(f"network model parameters must be > 0, got {bad}")

    def stage_seconds(self, stage: Sequence[Transfer], row_bytes: dict[str, int]) -> float:
        gpu_out: dict[int, int] = defaultdict(int)
        gpu_in: dict[int, int] = defaultdict(int)
        nic_out: dict[int, int] = defaultdict(int)
        nic_in: dict[int, int] = defaultdict(int)
        msgs_out: dict[int, set[int]] = defaultdict(set)
        msgs_in: dict[int, set[int]] = defaultdict(set)
        for t in stage:
            if t.src == t.dst:
                continue
            n = t.nbytes(row_bytes)
            src_node, dst_node = t.src // self.gpus_per_node, t.dst // self.gpus_per_node
            if src_node == dst_node:
                gpu_out[t.src] += n
                gpu_in[t.dst] += n
            else:
                nic_out[src_node] += n
                nic_in[dst_node] += n
            msgs_out[t.src].add(t.dst)  # one packed buffer per peer
            msgs_in[t.dst].add(t.src)
        nv = max([*gpu_out.values(), *gpu_in.values(), 0]) / (self.nvlink_gbps * 1e9)
        nic = max([*nic_out.values(), *nic_in.values(), 0]) / (self.nic_gbps * 1e9)
        msgs = max([len(v) for v in (*msgs_out.values(), *msgs_in.values())] or [0])
        moved = sum(gpu_out.values()) + sum(nic_out.values())
        shared = 0.0 if self.aggregate_gbps is None else moved / (self.aggregate_gbps * 1e9)
        packed: dict[int, int] = defaultdict(int)  # bytes a rank copies into its buffers
        slices: dict[int, int] = defaultdict(int)  # field slices it packs or unpacks
        for t in stage:
            if t.src != t.dst:
                packed[t.src] += t.nbytes(row_bytes)
                slices[t.src] += len(t.piece.fields)
                slices[t.dst] += len(t.piece.fields)
        host = self.host_seconds(packed, slices)
        return max(nv, nic, shared) + host + msgs * self.latency_us * 1e-6

    def host_seconds(self, copied: dict[int, int], slices: dict[int, int]) -> float:
        """CPU work of the ranks: bytes each copies (``copy_gbps``) plus field slices each
        handles (``slice_us``), as long as the busiest rank's, or all ranks' over ``cores`` when
        they share fewer cores than there are ranks. 0 without ``copy_gbps``/``slice_us``."""
        work: dict[int, float] = defaultdict(float)
        if self.copy_gbps is not None:
            for r, n in copied.items():
                work[r] += n / (self.copy_gbps * 1e9)
        if self.slice_us is not None:
            for r, n in slices.items():
                work[r] += n * self.slice_us * 1e-6
        if not work:
            return 0.0
        shared = sum(work.values()) / self.cores if self.cores is not None else 0.0
        return max(max(work.values()), shared)

    def assemble_seconds(self, needs: dict[int, list[Piece]], schema: Schema) -> float:
        """Receivers copying their pieces into micro-batches (after the last stage)."""
        row_bytes = {s.name: s.row_bytes for s in schema}
        copied = {
            r: sum(Transfer(r, r, p).nbytes(row_bytes) for p in ps) for r, ps in needs.items()
        }
        slices = {r: sum(len(p.fields) for p in ps) for r, ps in needs.items()}
        return self.host_seconds(copied, slices)

    def all_gather_seconds(self, world: int, nbytes: int) -> float:
        """An all-gather of ``nbytes`` per rank: ``ceil(log2 world)`` message latencies, each node
        receiving the other nodes' bytes once over its NIC and each GPU everything over NVLink."""
        if world <= 1:
            return 0.0
        steps = (world - 1).bit_length()
        remote = (world - min(world, self.gpus_per_node)) * nbytes / (self.nic_gbps * 1e9)
        local = (min(world, self.gpus_per_node) - 1) * nbytes / (self.nvlink_gbps * 1e9)
        return steps * self.latency_us * 1e-6 + remote + local

    def seconds(self, stages: Sequence[Sequence[Transfer]], schema: Schema) -> float:
        """Projected time of ``stages`` run one after the other."""
        row_bytes = {s.name: s.row_bytes for s in schema}
        return sum(self.stage_seconds(stage, row_bytes) for stage in stages)
