"""Tokens/s per (phase, layout, context-length bucket): measured cells, live refresh, and an
analytic roofline for the cells never measured.

    table = ThroughputTable(Roofline(model, HardwareSpec.h100()), world_size=32)
    table.record(Phase.TRAIN, layout, length=6000, tokens=48000, seconds=2.1)  # profiling, live
    table.predict(Phase.TRAIN, layout, length=6000)  # measured or analytic

Buckets are powers of two (``bucket_of``: 3000 -> 4096). A measurement updates its cell with an
exponential moving average (``ema``; the first one sets it). A cell never measured is predicted by
the roofline, scaled by the geometric mean of measured / roofline over the measured cells of the
same phase (so on CPU, where the absolute roofline is off, the ranking of layouts still uses the
measured level).

Roofline (whole world, tokens/s): training costs 6 N + 6 L s_avg d_attn FLOPs per token (fwd + bwd;
x 4/3 with full recompute), experience 2 N + 2 L s_avg d_attn, both at ``mfu`` of peak; rollout
decode is memory bound: one step reads the rank's weights and its KV cache at ``mbu`` of HBM
bandwidth and yields one token per sequence. Parallel efficiency per axis: tp ``tp_eff`` per
doubling inside a node (``tp_cross_node`` beyond), cp ``cp_eff`` per doubling, pp the 1F1B bubble
m / (m + pp - 1), dp ``dp_eff`` per doubling. Pure: no torch, no processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.vocab import PHASES, Phase
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.memory import MemoryModel, PhaseWorkload


def bucket_of(length: int, smallest: int = 256) -> int:
    """The power-of-two bucket holding ``length`` tokens (at least ``smallest``)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    return max(smallest, 1 << math.ceil(math.log2(length)))


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator's peaks and the efficiencies the roofline assumes."""

    peak_flops: float
    """Dense peak FLOP/s in the compute dtype."""
    hbm_bytes_per_s: float
    """Memory bandwidth."""
    gpus_per_node: int = 8
    """Ranks sharing the fast intra-node link (TP beyond it is penalised)."""
    mfu: float = 0.4
    """Model-FLOPs utilisation of a well-tuned single-rank step."""
    mbu: float = 0.6
    """Memory-bandwidth utilisation of decoding."""
    tp_eff: float = 0.93
    """Efficiency per doubling of tp inside a node."""
    tp_cross_node: float = 0.5
    """Extra factor when tp spans nodes."""
    cp_eff: float = 0.95
    """Efficiency per doubling of cp."""
    dp_eff: float = 0.99
    """Efficiency per doubling of dp."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "hbm_bytes_per_s", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("mfu", "mbu", "tp_eff", "tp_cross_node", "cp_eff", "dp_eff"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")

    @classmethod
    def h100(cls) -> HardwareSpec:
        """H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3."""
        return cls(peak_flops=989e12, hbm_bytes_per_s=3.35e12)

    @classmethod
    def cpu(cls) -> HardwareSpec:
        """A 2-core CPU: ~50 GFLOP/s fp32 per rank, ~10 GB/s; comm is costly."""
        return cls(peak_flops=5e10, hbm_bytes_per_s=1e10, gpus_per_node=64, tp_eff=0.8, cp_eff=0.8)


class Roofline:
    """Analytic tokens/s of a phase in a layout (module docstring)."""

    def __init__(self, model: ModelConfig, hardware: HardwareSpec, recompute: str | None = None):
        self.model = model
        self.hw = hardware
        self.recompute = recompute
        self.memory = MemoryModel(model)

    def efficiency(self, layout: ParallelLayout, num_micro_batches: int = 8) -> float:
        hw = self.hw
        eff = hw.tp_eff ** math.log2(layout.tp)
        if layout.tp > hw.gpus_per_node:
            eff *= hw.tp_cross_node
        eff *= hw.cp_eff ** math.log2(layout.cp)
        eff *= num_micro_batches / (num_micro_batches + layout.pp - 1)
        return eff * hw.dp_eff ** math.log2(layout.dp)

    def flops_per_token(self, phase: str, seq_len: int) -> float:
        m = self.model
        dense = m.num_parameters() - m.padded_vocab_size * m.hidden_size  # embedding is a lookup
        attn = m.num_layers * seq_len * m.num_attention_heads * m.head_dim  # causal: s/2 avg x 2
        fwd = 2 * dense + 2 * attn
        if phase == Phase.EXPERIENCE:
            return fwd
        return fwd * (4 if self.recompute == "full" else 3)

    def tokens_per_s(
        self, phase: str, layout: ParallelLayout, seq_len: int, concurrent_sequences: int = 32
    ) -> float:
        """Whole-world tokens/s (rollout: generated tokens/s at ``concurrent_sequences`` per
        engine replica)."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        world = layout.world_size
        if phase == Phase.ROLLOUT:
            work = PhaseWorkload(
                Phase.ROLLOUT, seq_len, seq_len, concurrent_sequences=concurrent_sequences
            )
            read = self.memory.stage_parameters(layout) * self.memory.param_bytes
            read += self.memory.kv_cache(layout, work)
            step_s = read / (self.hw.hbm_bytes_per_s * self.hw.mbu) * layout.pp
            return layout.dp * concurrent_sequences / step_s * self.efficiency(layout, 1) ** 0.5
        rate = self.hw.peak_flops * self.hw.mfu / self.flops_per_token(phase, seq_len)
        return world * rate * self.efficiency(layout)


class ThroughputTable:
    """Measured tokens/s per (phase, layout, bucket) with an EMA refresh and a roofline fallback."""

    def __init__(self, roofline: Roofline, ema: float = 0.3) -> None:
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        self.roofline = roofline
        self.ema = ema
        self.cells: dict[tuple[str, str, int], float] = {}
        self.counts: dict[tuple[str, str, int], int] = {}

    def record(
        self, phase: str, layout: ParallelLayout, length: int, tokens: float, seconds: float
    ) -> float:
        """Fold one measurement (``tokens`` processed in ``seconds`` at context ``length``) into
        its cell; returns the cell's new value."""
        if seconds <= 0 or tokens <= 0:
            raise ValueError(f"need tokens > 0 and seconds > 0, got {tokens}, {seconds}")
        key = (phase, str(layout), bucket_of(length))
        value = tokens / seconds
        old = self.cells.get(key)
        self.cells[key] = value if old is None else (1 - self.ema) * old + self.ema * value
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.cells[key]

    def measured(self, phase: str, layout: ParallelLayout, length: int) -> float | None:
        return self.cells.get((phase, str(layout), bucket_of(length)))

    def _scale(self, phase: str) -> float:
        ratios = []
        for (p, name, bucket), value in self.cells.items():
            if p == phase:
                layout = ParallelLayout.parse(name)
                ratios.append(value / self.roofline.tokens_per_s(phase, layout, bucket))
        if not ratios:
            return 1.0
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    def predict(self, phase: str, layout: ParallelLayout, length: int) -> tuple[float, str]:
        """(tokens/s, source): source is "measured" or "roofline"."""
        value = self.measured(phase, layout, length)
        if value is not None:
            return value, "measured"
        analytic = self.roofline.tokens_per_s(phase, layout, bucket_of(length))
        return analytic * self._scale(phase), "roofline"
