"""What a run config holds on each GPU, phase by phase: ``megatron-earl plan CONFIG --gpu NAME``
and the memory part of ``megatron-earl check``.

    fp = footprint(load_config("configs/qwen2.5-7b_grpo.yaml"), gpu_preset("h100-80gb").bytes)
    fp.problems          # [] when every phase fits; else the term that does not and the fix
    print(format_footprint(fp, "configs/qwen2.5-7b_grpo.yaml", "h100-80gb"))

Per rank, on the most loaded rank of each phase's layout (``layouts.*``: where the run starts;
with the selector on, its later choices are held to ``selector.budget_mb``), by the memory model
of ``memory.py`` with the GPU defaults, the run's recompute and optimizer, and nothing offloaded
(the RL loop keeps its state on the device between phases):

* resident for the whole run: the master copy in ``layouts.train`` (weights, gradients, Adam),
  the weights of every other layout the policy is built in (``layouts.rollout`` with the
  embedded engine, ``layouts.experience`` when the old log-probs pass runs), the reference
  policy's weights (``kl_coef > 0``), Megatron's cached RoPE tables, and the embedded engine's
  KV cache and RoPE tables;
* per phase: activations, log-prob buffers (the rollout's next-token logits), the fixed
  overhead (CUDA context, NCCL, allocator slack).

The embedded engine's KV cache (``kv_sizing``) is sized like SGLang's ``mem_fraction_static``:
``rollout.embedded.kv_memory_fraction`` x the GPU's memory, less the resident weights and train
state, in whole rows of ``rollout.max_context`` tokens, at most ``min(rollout.max_concurrency,
MAX_ENGINE_ROWS)`` rows (``rollout.embedded.kv_cache_mb``: an explicit budget instead). So
every phase's peak is at most the fraction x memory plus that phase's own activations, buffers
and overhead: the config fits when those fit in the rest.

Workload: the worst the config allows, every sequence at ``rollout.max_context``: the rollout
prefills one such context and decodes one token per row; the experience phase runs the step's
samples, the train phase one mini-batch's, spread over DP and packed into micro-batches of
``batch.max_tokens_per_micro_batch`` per rank as the loop does (``PhaseWorkload.for_lengths``).
Pure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_earl.config.embedded import MAX_ENGINE_ROWS, kv_cache_rows
from megatron_earl.config.run import RunConfig
from megatron_earl.config.vocab import EngineKind, Phase
from megatron_earl.parallel.layout import ParallelLayout, phase_layout
from megatron_earl.selector.memory import (
    GiB,
    MemoryModel,
    MemorySettings,
    MiB,
    PhaseWorkload,
    ReservedKV,
)


@dataclass(frozen=True)
class GpuPreset:
    """A GPU model and its published memory."""

    name: str
    memory_gib: float
    """The data sheet's memory, "80GB", as GiB: the HBM stacks hold 80 GiB; what the driver
    keeps back (under 1 GiB) is inside the memory model's 3 GiB overhead."""
    product: str

    @property
    def bytes(self) -> float:
        return self.memory_gib * GiB


GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        GpuPreset("a100-40gb", 40, "NVIDIA A100 40GB (SXM4 / PCIe)"),
        GpuPreset("a100-80gb", 80, "NVIDIA A100 80GB (SXM4 / PCIe)"),
        GpuPreset("h100-80gb", 80, "NVIDIA H100 80GB (SXM5 / PCIe)"),
        GpuPreset("h100-94gb", 94, "NVIDIA H100 NVL 94GB"),
        GpuPreset("h200-141gb", 141, "NVIDIA H200 141GB"),
        GpuPreset("b200-180gb", 180, "NVIDIA B200 in HGX/DGX B200 (1,440 GB per 8 GPUs)"),
    )
}
"""``--gpu`` names (``megatron-earl plan``, ``check``) and their published memory."""


def gpu_preset(name: str) -> GpuPreset:
    """The preset ``name`` (case-insensitive); ``ValueError`` naming the valid ones."""
    preset = GPU_PRESETS.get(name.lower())
    if preset is None:
        raise ValueError(f"unknown GPU {name!r}; valid: {', '.join(GPU_PRESETS)}")
    return preset


DECLARED_GPU = re.compile(r"^#\s*gpu:\s*(\S+)", re.MULTILINE)
"""The line of a config file naming the GPU it is written for: ``# gpu: h100-80gb``."""


def declared_gpu(path: str | Path) -> str | None:
    """The GPU preset a config file names on its ``# gpu: NAME`` line, or None."""
    found = DECLARED_GPU.search(Path(path).read_text())
    return found.group(1) if found else None


def gpu_settings(config: RunConfig) -> MemorySettings:
    """The memory model's GPU settings for ``config``: its recompute and optimizer, and the
    train state resident in every phase (the RL loop offloads nothing)."""
    return MemorySettings.gpu(
        recompute=config.model.recompute_granularity,
        use_distributed_optimizer=config.train.use_distributed_optimizer,
        train_state_resident=True,
    )


def _embedded(config: RunConfig) -> bool:
    return config.rollout.engine == EngineKind.EMBEDDED


def policy_copies(config: RunConfig, rollout: ParallelLayout | None = None) -> list[ParallelLayout]:
    """Layouts holding a weights-only copy of the policy beside the master (``layouts.train``):
    the rollout layout with the embedded engine (``rollout`` in place of ``layouts.rollout``),
    the experience layout when the old log-probs pass runs; each once, the master's excluded."""
    train = phase_layout(config.layouts, Phase.TRAIN)
    wanted = []
    if _embedded(config):
        wanted.append(rollout or phase_layout(config.layouts, Phase.ROLLOUT))
    if config.old_logprobs_pass():
        wanted.append(phase_layout(config.layouts, Phase.EXPERIENCE))
    return [
        layout for i, layout in enumerate(wanted) if layout != train and layout not in wanted[:i]
    ]


def resident_state(
    config: RunConfig, memory: MemoryModel, rollout: ParallelLayout | None = None
) -> tuple[float, float]:
    """(weights, train state) bytes per rank living for the whole run: the master's weights plus
    every copy's and the reference policy's; its gradients and optimizer state. The most loaded
    rank of each layout is assumed to be the same rank (an upper bound)."""
    train = phase_layout(config.layouts, Phase.TRAIN)
    weights, grads, optim = memory.train_state(train)
    for layout in policy_copies(config, rollout):
        weights += memory.stage_parameters(layout) * memory.param_bytes
    if config.train.loss.kl_coef > 0:
        experience = phase_layout(config.layouts, Phase.EXPERIENCE)
        weights += memory.stage_parameters(experience) * memory.param_bytes
    return weights, grads + optim


@dataclass(frozen=True)
class KVSizing:
    """The embedded engine's KV cache on one rank of its layout (``kv_sizing``)."""

    layout: ParallelLayout
    max_rows: int
    """``min(rollout.max_concurrency, MAX_ENGINE_ROWS)``."""
    context: int
    """Tokens per row (``rollout.max_context``)."""
    row_bytes: float
    budget_bytes: float | None
    """What the cache may take; None: no memory figure (``max_rows`` rows)."""
    rows: int
    """Rows allocated (0: the budget holds none; the engine cannot start)."""
    resident_bytes: float
    """Weights and train state the fraction's share was reduced by."""
    rule: str
    """How the budget was set, for messages."""

    @property
    def bytes(self) -> float:
        return self.rows * self.row_bytes

    def reserved(self) -> ReservedKV:
        """The cache as the memory model's ``ReservedKV`` (at least one row)."""
        return ReservedKV(max(1, self.rows), self.context)


def kv_sizing(
    config: RunConfig, device_bytes: float | None, rollout: ParallelLayout | None = None
) -> KVSizing:
    """The KV cache of the embedded engine of ``rollout`` (default ``layouts.rollout``):
    ``rollout.embedded.kv_cache_mb`` when set; else, with ``device_bytes`` (the GPU's memory),
    ``kv_memory_fraction`` x it less the resident weights and train state
    (``resident_state``); else (no memory figure: the CPU) no budget. Rows: what the budget
    holds, at most ``min(rollout.max_concurrency, MAX_ENGINE_ROWS)`` (``kv_cache_rows``)."""
    layout = rollout or phase_layout(config.layouts, Phase.ROLLOUT)
    memory = MemoryModel(config.model, gpu_settings(config))
    settings = config.rollout.embedded
    max_rows = min(config.rollout.max_concurrency, MAX_ENGINE_ROWS)
    context = config.rollout.max_context
    row = memory.kv_row_bytes(layout, context)
    resident = sum(resident_state(config, memory, layout))
    if settings.kv_cache_mb is not None:
        budget = settings.kv_cache_mb * MiB
        rule = f"rollout.embedded.kv_cache_mb = {_gib(budget)}"
    elif device_bytes is not None:
        fraction = settings.kv_memory_fraction
        budget = fraction * device_bytes - resident
        rule = (
            f"kv_memory_fraction {fraction:g} x {_gib(device_bytes)} - {_gib(resident)} "
            f"weights and train state = {_gib(budget)}"
        )
    else:
        budget, rule = None, "no memory figure: min(rollout.max_concurrency, 64) rows"
    rows = kv_cache_rows(max_rows, row, budget)
    return KVSizing(layout, max_rows, context, row, budget, rows, resident, rule)


@dataclass(frozen=True)
class PhaseFootprint:
    """One phase's predicted peak per rank, by term (bytes)."""

    phase: str
    layout: ParallelLayout
    terms: dict[str, float]
    """``TERMS`` -> bytes."""

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def transient(self) -> float:
        """What the phase adds to the resident state."""
        return sum(self.terms[t] for t in TRANSIENT)


RESIDENT = ("weights", "train_state", "kv_cache", "rotary_tables")
TRANSIENT = ("activations", "logprob_buffers", "overhead")
TERMS = RESIDENT + TRANSIENT


@dataclass(frozen=True)
class Footprint:
    """A config's per-phase peaks on a GPU of ``device_bytes`` (``footprint``)."""

    device_bytes: float
    world_size: int
    phases: list[PhaseFootprint]
    kv: KVSizing | None
    """The embedded engine's cache; None with SGLang engines (their own GPUs)."""
    problems: list[str]

    @property
    def headroom(self) -> float:
        """Bytes left on the tightest phase (negative: out of memory)."""
        return self.device_bytes - max(p.total for p in self.phases)

    def as_dict(self) -> dict:
        return {
            "device_gib": self.device_bytes / GiB,
            "world_size": self.world_size,
            "kv_cache": None
            if self.kv is None
            else {
                "layout": str(self.kv.layout),
                "rows": self.kv.rows,
                "max_rows": self.kv.max_rows,
                "context": self.kv.context,
                "row_gib": self.kv.row_bytes / GiB,
                "budget_gib": None if self.kv.budget_bytes is None else self.kv.budget_bytes / GiB,
            },
            "phases": [
                {
                    "phase": p.phase,
                    "layout": str(p.layout),
                    **{f"{t}_gib": b / GiB for t, b in p.terms.items()},
                    "peak_gib": p.total / GiB,
                    "headroom_gib": (self.device_bytes - p.total) / GiB,
                }
                for p in self.phases
            ],
            "headroom_gib": self.headroom / GiB,
            "problems": self.problems,
        }


def phase_workload(
    config: RunConfig, phase: str, layout: ParallelLayout, kv: KVSizing | None
) -> PhaseWorkload:
    """The worst workload ``config`` allows ``phase`` (module docstring)."""
    context = config.rollout.max_context
    if phase == Phase.ROLLOUT:
        rows = max(1, kv.rows) if kv is not None else 1
        return PhaseWorkload(
            phase,
            max_seq_len=context,
            tokens_per_micro_batch=context,
            concurrent_sequences=rows,
            reserved_kv=kv.reserved() if kv is not None else None,
        )
    samples = config.batch.samples_per_step
    if phase == Phase.TRAIN:
        samples = max(1, samples // config.batch.num_mini_batches)
    return PhaseWorkload.for_lengths(
        phase,
        [context] * samples,
        token_budget=config.batch.max_tokens_per_micro_batch,
        dp=layout.dp,
        cp=layout.cp,
    )


def footprint(config: RunConfig, device_bytes: float) -> Footprint:
    """Every phase's predicted peak per rank on a GPU of ``device_bytes``, and why it does not
    fit (``problems``, empty when it does). Pure."""
    memory = MemoryModel(config.model, gpu_settings(config))
    train = phase_layout(config.layouts, Phase.TRAIN)
    kv = kv_sizing(config, device_bytes) if _embedded(config) else None
    weights, train_state = resident_state(config, memory)
    phases = [Phase.ROLLOUT] if kv is not None else []
    phases += [Phase.EXPERIENCE] if config.old_logprobs_pass() else []
    phases.append(Phase.TRAIN)
    breakdowns = {}
    for phase in phases:
        layout = phase_layout(config.layouts, phase)
        work = phase_workload(config, phase, layout, kv)
        breakdowns[phase] = (layout, memory.peak(phase, layout, work, train_layout=train))
    # Megatron's cached RoPE tables (train/experience) stay for the run, and so do the engine's
    megatron_rope = max(b.rotary_tables for p, (_, b) in breakdowns.items() if p != Phase.ROLLOUT)
    engine_rope = breakdowns[Phase.ROLLOUT][1].rotary_tables if kv is not None else 0.0
    out = []
    for phase, (layout, b) in breakdowns.items():
        terms = {
            "weights": weights,
            "train_state": train_state,
            "kv_cache": kv.bytes if kv is not None else 0.0,
            "rotary_tables": megatron_rope + engine_rope,
            "activations": b.activations,
            "logprob_buffers": b.logprob_buffers,
            "overhead": b.overhead,
        }
        out.append(PhaseFootprint(phase, layout, terms))
    result = Footprint(device_bytes, train.world_size, out, kv, [])
    return replace(result, problems=footprint_problems(config, result))


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def footprint_problems(config: RunConfig, fp: Footprint) -> list[str]:
    """Why ``fp`` does not fit: the embedded engine's cache holds no row, or a phase's peak is
    above the GPU's memory; each names the term and what would fix it. Pure."""
    device, kv = fp.device_bytes, fp.kv
    first = fp.phases[0].terms
    static = first["weights"] + first["train_state"]
    where = f"{_gib(static)} per GPU ({_gib(first['weights'])} weights of every copy, " + (
        f"{_gib(first['train_state'])} gradients and optimizer state in layouts.train "
        f"{fp.phases[-1].layout})"
    )
    problems = []
    explicit = config.rollout.embedded.kv_cache_mb is not None
    fraction = config.rollout.embedded.kv_memory_fraction
    # the largest fraction with which every phase fits: the cache fills fraction x memory at most
    worst = max(fp.phases, key=lambda p: p.transient + p.terms["rotary_tables"])
    fraction_max = (
        math.floor(100 * (device - worst.transient - worst.terms["rotary_tables"]) / device) / 100
    )
    if kv is not None and kv.rows < 1:
        row = (
            f"one row of rollout.max_context ({kv.context} tokens) at {kv.layout} is "
            f"{kv.row_bytes / MiB:.0f} MiB"
        )
        shorter = math.floor(max(kv.budget_bytes, 0) / kv.row_bytes * kv.context)
        fixes = [f"rollout.max_context <= {shorter}" if shorter > 0 else None]
        if kv.layout.tp < config.model.query_groups:
            fixes.append("a layouts.rollout with more tp (fewer KV heads per GPU)")
        if explicit:
            fixes.append(f"rollout.embedded.kv_cache_mb >= {math.ceil(kv.row_bytes / MiB)}")
            term = f"rollout.embedded.kv_cache_mb ({config.rollout.embedded.kv_cache_mb:g} MiB)"
        else:
            need = math.ceil(100 * (kv.resident_bytes + kv.row_bytes) / device) / 100
            if need <= min(1.0, fraction_max):
                fixes.append(f"rollout.embedded.kv_memory_fraction >= {need:.2f}")
            if static > fraction * device:
                fixes.append(
                    "layouts that hold less per GPU (more tp/pp, or more dp x cp with "
                    "train.use_distributed_optimizer)"
                )
            term = (
                f"rollout.embedded.kv_memory_fraction {fraction:g} x {_gib(device)} leaves "
                f"{_gib(kv.budget_bytes)} for the KV cache after the weights and train state, "
                + where
            )
        problems.append(
            f"KV cache: {term}: the embedded engine's cache holds no row ({row}); fix: "
            + ", or ".join(f for f in fixes if f)
        )
    for p in fp.phases:
        if p.total <= device:
            continue
        big = max(TERMS, key=lambda t: p.terms[t])
        parts = ", ".join(f"{t} {_gib(b)}" for t, b in p.terms.items() if b)
        fixes = []
        if kv is not None and kv.rows >= 1:
            # fraction_max bounds every phase's peak by the memory, while its cache holds a row
            if not explicit and fraction_max * device - kv.resident_bytes >= kv.row_bytes:
                fixes.append(f"rollout.embedded.kv_memory_fraction <= {fraction_max:.2f}")
            over = math.ceil((p.total - device) / kv.row_bytes)
            if kv.rows - over >= 1:
                mib = math.floor((kv.rows - over) * kv.row_bytes / MiB)
                fixes.append(
                    f"{kv.rows - over} KV rows (rollout.max_concurrency <= {kv.rows - over}, or "
                    f"rollout.embedded.kv_cache_mb <= {mib})"
                )
        if big in ("weights", "train_state"):
            fixes.append(
                f"a layouts.{p.phase} that holds less per GPU (more tp/pp, or more dp x cp with "
                "train.use_distributed_optimizer)"
            )
        if p.terms["activations"] > 0.1 * device or big == "activations":
            fixes.append(
                f"fewer tokens per micro-batch (batch.max_tokens_per_micro_batch) or more tp/cp "
                f"in layouts.{p.phase}"
            )
        problems.append(
            f"{p.phase} in {p.layout} needs {_gib(p.total)} per GPU, over the GPU's "
            f"{_gib(device)} by {_gib(p.total - device)} ({parts}); the largest term is {big}; "
            f"fix: " + (", or ".join(fixes) or "a larger GPU")
        )
    return problems


def misfit(fp: Footprint, gpu: str) -> str | None:
    """``fp``'s problems as one message, ``"does not fit GPU:"`` and one line per problem; None
    when it fits. Pure (the pre-flights of ``cli.check`` and ``cli.checked_torchrun``)."""
    if not fp.problems:
        return None
    return f"does not fit {gpu}:\n" + "\n".join(f"  - {p}" for p in fp.problems)


def format_footprint(fp: Footprint, name: str, gpu: str) -> str:
    """The plan table of ``fp`` (``megatron-earl plan CONFIG``)."""
    lines = [
        f"plan: {name} on {fp.world_size} x {gpu} ({_gib(fp.device_bytes)} per GPU; "
        "predicted by the memory model, no GPU used)"
    ]
    if fp.kv is None:
        lines.append("rollout: on the SGLang engines' own GPUs (their --mem-fraction-static)")
    else:
        kv = fp.kv
        lines.append(
            f"KV cache (embedded engine, {kv.layout}): {kv.rule} -> {kv.rows} rows of "
            f"{kv.context} tokens ({kv.row_bytes / MiB:.1f} MiB a row; at most {kv.max_rows} = "
            f"min(rollout.max_concurrency, {MAX_ENGINE_ROWS})) = {_gib(kv.bytes)}: "
            + (
                f"{kv.rows} requests decode at once per engine, more wait for a row"
                if kv.rows
                else "it holds no row, the engine cannot start"
            )
        )
    header = ["phase", "layout", *TERMS, "peak", "headroom"]
    short = {
        "train_state": "train st",
        "kv_cache": "KV cache",
        "rotary_tables": "RoPE",
        "logprob_buffers": "buffers",
        "activations": "activ.",
    }
    lines.append(
        f"{header[0]:<11}{header[1]:<15}"
        + "".join(f"{short.get(h, h):>10}" for h in header[2:])
        + "   (GiB per GPU)"
    )
    for p in fp.phases:
        values = [*(p.terms[t] for t in TERMS), p.total, fp.device_bytes - p.total]
        lines.append(
            f"{p.phase:<11}{p.layout!s:<15}" + "".join(f"{v / GiB:>10.2f}" for v in values)
        )
    if fp.problems:
        lines.append("does not fit:")
        lines.extend(f"  - {problem}" for problem in fp.problems)
    else:
        tight = max(fp.phases, key=lambda p: p.total)
        lines.append(
            f"fits: headroom {_gib(fp.headroom)} per GPU on the tightest phase ({tight.phase})"
        )
    return "\n".join(lines)
