"""A network model that projects a plan's transfer stages onto a GPU cluster (pure).

Cluster: ``gpus_per_node`` consecutive ranks per node. Inside a node every GPU has its own NVLink
bandwidth per direction; between nodes every node has one NIC bandwidth per direction, shared by
its GPUs. A stage takes as long as its busiest link (bandwidth-bound: the largest of every GPU's
NVLink bytes out/in and every node's NIC bytes out/in, each over its bandwidth) plus a per-message
latency times the largest number of messages one rank sends or receives. Stages run one after the
other. Local copies (src == dst) are free.

The model ignores congestion inside the fabric and overlap between stages; it is applied to the
decentralized and the centralized stages of the same plan, so what it compares is the routing.

Two optional terms describe a host rather than a GPU cluster (the local benchmark calibrates
them, ``bench.calibrate``): ``aggregate_gbps`` caps what all ranks move together (processes
sharing a few CPU cores), ``copy_gbps`` charges each rank's packing and unpacking of its wire
buffers. ``all_gather_seconds`` models the metadata all-gather (recursive doubling).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from megatron_earl.dispatch.batch import Schema
from megatron_earl.dispatch.route import DispatchError, Transfer


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
    """GB/s one rank packs (sends) plus unpacks (receives); None: copies are free (GPU copies
    run far faster than the links)."""

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
        copy = 0.0
        if self.copy_gbps is not None:
            out: dict[int, int] = defaultdict(int)
            for t in stage:
                if t.src != t.dst:
                    n = t.nbytes(row_bytes)
                    out[t.src] += n
                    out[t.dst] += n
            copy = max(out.values(), default=0) / (self.copy_gbps * 1e9)
        return max(nv, nic, shared) + copy + msgs * self.latency_us * 1e-6

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
