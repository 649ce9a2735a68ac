"""Per-rank peak-memory model of each phase (rollout, experience, train) in a parallel layout.

    mem = MemoryModel(model_config, MemorySettings.gpu())
    work = PhaseWorkload.for_lengths(Phase.TRAIN, lengths, token_budget=8192)
    breakdown = mem.peak(Phase.TRAIN, ParallelLayout(tp=4, cp=2, dp=4), work)    # bytes per rank
    breakdown.total, breakdown.as_dict()

Terms (bytes on the most loaded rank: the first or last pipeline stage):

* weights: the stage's parameters / tp (norms replicated), embedding on the first stage, the
  output layer on the last (untied), in the params dtype;
* gradients (train; every phase when ``train_state_resident``): Megatron DDP's grad buffer,
  ``grad_bytes`` per local parameter (fp32);
* optimizer (train): Adam's two fp32 moments, plus an fp32 master copy when the params dtype is
  not fp32; divided by dp with the distributed optimizer;
* activations: saved tensors per token per layer (``activation_elements_per_token``: residual
  stream and norms, QKV, rotated Q/K, GQA-expanded K/V, attention output, SwiGLU), times layers
  per stage, times micro-batches in flight (1F1B holds min(pp, micro-batches) on the first stage),
  times the rank's tokens of one micro-batch (CP divides the sequence). Attention runs on SDPA /
  flash: no s^2 term, except the CP attention of this project on CPU whose causal masks hold
  (2 cp + 1) (s / 2cp)^2 elements per sequence and layer (``cp_mask_bytes``, 0 on GPU/TE).
  Recompute: "full" keeps only each layer's input plus one layer's activations; "selective" drops
  the core-attention tensors. Forward-only phases keep no activations: one layer's transient;
* log-prob buffers: the chunked output layer (``training.logprobs``) holds a few
  ``chunk x V/tp`` fp32 buffers, whatever the sequence length;
* KV cache (rollout): layers/pp x 2 x kv heads/tp x head dim x tokens x bytes, tokens being the
  concurrent sequences x the longest (a paged pool), or, for an engine that allocates its cache
  whole when it is built (``ReservedKV``: the embedded engine's row cache), its rows x its
  context limit whatever the batch, the rows being those its memory budget holds next to the
  weights and train state (``rollout.embedded.kv_memory_fraction`` / ``kv_cache_mb``);
* overhead: a fixed per-rank amount (framework, communicator buffers).

In the RL loop the trainable master copy (weights, gradients, optimizer state) lives in the train
layout while rollout/experience run in theirs (``peak(..., train_layout=)``): those phases hold
their own weights plus the master's state. The workload (``PhaseWorkload.for_lengths``) is the
most loaded DP replica's, with the dispatcher's balancing and the train step's micro-batch packing
run on the batch's lengths (memoised).

Activations and log-prob buffers are scaled by per-phase constants (``activation_scale``,
``fixed_bytes``) fitted by ``calibrate.fit`` from short CPU runs of the real model, and, where a
(phase, layout) has been measured at two sizes or more, by that layout's own fit
(``layout_fit``: scale and intercept of everything but the static state and CP masks). On GPU the
analytic defaults (scale 1) are used until measurements arrive. A fitted negative constant never
takes the prediction below the static state. Pure: no processes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from megatron_earl.config.embedded import kv_cache_rows
from megatron_earl.config.model import ModelConfig, sequence_parallel_size
from megatron_earl.config.vocab import PHASES, Phase
from megatron_earl.parallel.layout import ParallelLayout

GiB = 1 << 30
MiB = 1 << 20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def per_rank(num_bytes: float) -> str:
    """``num_bytes`` for messages: "1.250 GiB per rank", with MiB added below 1 GiB."""
    small = f" ({num_bytes / MiB:.2f} MiB)" if num_bytes < GiB else ""
    return f"{num_bytes / GiB:.3f} GiB per rank{small}"


@dataclass(frozen=True)
class ReservedKV:
    """A rollout engine's KV cache allocated whole when the engine is built, whatever the batch:
    ``rows`` rows of ``context`` tokens per engine replica (the embedded engine's row cache,
    ``rollout/embedded/kv_cache.py``; its RoPE tables span ``context`` too)."""

    rows: int
    """Requests the engine decodes at once at most (the embedded engine: ``rollout.
    max_concurrency``, at most ``config.embedded.MAX_ENGINE_ROWS``); fewer when a budget below
    holds fewer rows (``config.embedded.kv_cache_rows``, the engine's own sizing)."""
    context: int
    """Tokens per row: the engine's context limit (``rollout.max_context``; a compiled engine
    adds one spare position, less than 1 / context of the cache, not counted)."""
    budget_bytes: float | None = None
    """An explicit KV-cache budget per rank (``rollout.embedded.kv_cache_mb``)."""
    static_share_bytes: float | None = None
    """``kv_memory_fraction`` x the device's memory: the cache takes this less the rank's state
    (weights, train state) in the phase's layout. None (and no ``budget_bytes``): ``rows``."""

    def __post_init__(self) -> None:
        if self.rows < 1 or self.context < 1:
            raise ValueError(f"rows ({self.rows}) and context ({self.context}) must be >= 1")

    def rows_for(self, row_bytes: float, static_bytes: float) -> int:
        """Rows the engine allocates next to ``static_bytes`` of state, at least one (an engine
        that holds none cannot start: ``megatron-earl plan`` and ``check`` refuse it)."""
        budget = self.budget_bytes
        if budget is None and self.static_share_bytes is not None:
            budget = self.static_share_bytes - static_bytes
        return max(1, kv_cache_rows(self.rows, row_bytes, budget))


@dataclass(frozen=True)
class PhaseWorkload:
    """What one phase processes per data-parallel replica (the inputs of the memory model)."""

    phase: Phase
    """The phase (rollout, experience or train)."""
    max_seq_len: int
    """Longest sequence of the batch (tokens): nothing is truncated, so this one must fit."""
    tokens_per_micro_batch: int
    """Tokens of one micro-batch per DP replica before the CP split (>= max_seq_len)."""
    num_micro_batches: int = 1
    """Micro-batches per step per DP replica (bounds the micro-batches 1F1B keeps in flight)."""
    concurrent_sequences: int = 1
    """Rollout: sequences decoded at once by one engine replica (their KV cache is resident)."""
    reserved_kv: ReservedKV | None = None
    """Rollout: the engine's KV cache when it is allocated whole up front (``ReservedKV``); None:
    it holds the concurrent sequences' own tokens (a paged pool)."""

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase {self.phase!r} is not one of {PHASES}")
        small = {
            k: getattr(self, k)
            for k in ("max_seq_len", "num_micro_batches", "concurrent_sequences")
            if getattr(self, k) < 1
        }
        if small:
            raise ValueError(f"workload values must be >= 1, got {small}")
        if self.tokens_per_micro_batch < self.max_seq_len:
            raise ValueError(
                f"tokens_per_micro_batch ({self.tokens_per_micro_batch}) < max_seq_len "
                f"({self.max_seq_len}): a sequence is never split across micro-batches"
            )

    @classmethod
    def for_lengths(
        cls,
        phase: str,
        lengths: Sequence[int],
        *,
        token_budget: int = 8192,
        dp: int = 1,
        cp: int = 1,
        concurrent_sequences: int | None = None,
        reserved_kv: ReservedKV | None = None,
    ) -> PhaseWorkload:
        """The workload of the most loaded DP replica when a batch of sequence ``lengths`` is
        spread over ``dp`` replicas the way the dispatcher does (``dispatch.balance``) and packed
        into micro-batches the way the train step / log-prob pass does (the planner of
        ``training.microbatch.plan_micro_batches``: per-rank ``token_budget`` after the CP split,
        balanced token counts). A sequence above the budget is never split: it gets a
        micro-batch of its own (the loop's dispatcher refuses it; the planner still sizes it).
        Under prefix-shared packing the dispatcher balances whole groups and keeps a group in
        one micro-batch (``PlanConfig.prefer_groups``), which this model does not follow: its
        largest micro-batch may be fuller (up to the budget) and its rows shorter than this
        model's (docs/training.md, "Memory"); the selector re-fits from measured peaks."""
        if not lengths:
            raise ValueError("lengths is empty: a phase needs at least one sequence")
        key = (tuple(int(n) for n in lengths), token_budget, dp, cp)
        count, per_mb = _packing(*key)
        return cls(
            phase=phase,
            max_seq_len=max(lengths),
            tokens_per_micro_batch=per_mb,
            num_micro_batches=count,
            concurrent_sequences=concurrent_sequences or max(1, math.ceil(len(lengths) / dp)),
            reserved_kv=reserved_kv,
        )


@functools.lru_cache(maxsize=4096)
def _packing(lengths: tuple[int, ...], token_budget: int, dp: int, cp: int) -> tuple[int, int]:
    """(micro-batches, tokens of the largest before the CP split) of the most loaded replica
    (``PhaseWorkload.for_lengths``); memoised: the selector re-evaluates the same batches."""
    from megatron_earl.dispatch.balance import assign_samples
    from megatron_earl.dispatch.plan import balance_micro_batches
    from megatron_earl.dispatch.spec import PlanConfig
    from megatron_earl.parallel.cp import cp_padded_length

    table = {i: int(n) for i, n in enumerate(lengths)}
    if dp > 1 and len(table) >= dp:
        replicas = assign_samples(table, table, dp, PlanConfig())
        mine = max(([table[i] for i in r] for r in replicas), key=lambda r: (sum(r), max(r)))
    elif dp > 1:  # more replicas than sequences: one sequence each at most
        mine = [max(lengths)]
    else:
        mine = list(table.values())
    padded = [cp_padded_length(n, cp) for n in mine]
    budget = max(token_budget, max(padded) // cp)
    # the train step's packing (training.microbatch.plan_micro_batches); the budget fits every
    # sequence, so its over-budget check has nothing to refuse
    bins = balance_micro_batches(range(len(mine)), dict(enumerate(mine)), cp, budget)
    loads = [sum(padded[i] for i in b) for b in bins]
    return len(bins), max(max(loads), max(lengths))


ROTARY_LRU_ENTRIES = 32
"""``functools.lru_cache(maxsize=32)`` on Megatron-Core 0.16's ``RotaryEmbedding.forward`` and
``YarnRotaryEmbedding.forward``: one fp32 table per distinct (length, offset, packed) call."""


@dataclass(frozen=True)
class MemorySettings:
    """Numerics and constants of the memory model (``gpu()`` / ``cpu()`` give the defaults)."""

    grad_bytes: int = 4
    """Bytes per local parameter of the gradient buffer (Megatron DDP grad_reduce_in_fp32)."""
    use_distributed_optimizer: bool = True
    """Optimizer state (and fp32 master weights) sharded over DP (Megatron's ZeRO-1)."""
    recompute: str | None = None
    """Activation recompute: None, "selective" or "full"."""
    logprob_chunk_size: int = 1024
    """Tokens per output-layer chunk of the log-prob pass (``training.logprobs``)."""
    logprob_buffers: float = 4.0
    """fp32 ``chunk x V/tp`` buffers alive at once in the chunked output layer's backward (the
    forward-only pass of the experience phase holds half as many)."""
    activation_scale: dict[str, float] = field(default_factory=lambda: {p: 1.0 for p in PHASES})
    """Per-phase multiplier of the analytic activation bytes (fitted on CPU; 1 on GPU)."""
    fixed_bytes: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    """Per-phase fixed bytes added to the log-prob buffers (fitted on CPU)."""
    layout_fit: dict[str, tuple[float, float]] = field(default_factory=dict)
    """(activation scale, fixed bytes) fitted for one phase in one layout, keyed
    ``"phase/layout"`` (e.g. ``"experience/tp2cp1pp1dp1"``); takes precedence over the phase's
    ``activation_scale`` / ``fixed_bytes`` (``calibrate.fit`` with measurements of that layout)."""
    cp_mask_bytes: float = 0.0
    """Bytes per element of the causal masks of this project's CP attention kept for backward
    (CPU SDPA keeps an fp32 copy: 4); 0 where a ring/TE CP attention has no s^2 term."""
    overhead_bytes: float = 0.0
    """Fixed per-rank overhead (CUDA context, NCCL buffers, allocator slack)."""
    train_state_resident: bool = False
    """Gradients and optimizer state stay on the device during rollout and experience (no
    offload); False assumes they are offloaded while those phases run."""
    rotary_cache_entries: int = ROTARY_LRU_ENTRIES
    """Tables of Megatron's rotary LRU cache counted (an upper bound: it fills with the distinct
    packed lengths of a run); 0 where a calibration's fitted fixed bytes already hold them
    (``cpu()``)."""

    def __post_init__(self) -> None:
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(
                f"recompute {self.recompute!r} is not one of None, 'selective', 'full'"
            )
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        for name in ("activation_scale", "fixed_bytes"):
            missing = set(PHASES) - set(getattr(self, name))
            if missing:
                raise ValueError(f"{name} lacks phases {sorted(missing)}; give all of {PHASES}")

    @classmethod
    def gpu(cls, **overrides) -> MemorySettings:
        """Analytic defaults for NVIDIA GPUs (distributed optimizer, 3 GiB framework overhead)."""
        return cls(**{"overhead_bytes": 3.0 * GiB, **overrides})

    @classmethod
    def cpu(cls, **overrides) -> MemorySettings:
        """Defaults for the CPU runs of this project (plain optimizer, CP masks on SDPA)."""
        return cls(
            **{
                "use_distributed_optimizer": False,
                "train_state_resident": True,
                "cp_mask_bytes": 4.0,
                "logprob_chunk_size": 512,
                # the calibration's fixed bytes hold the (few, small) tables a CPU run creates
                "rotary_cache_entries": 0,
                # fitted by calibrate.fit on dp2/tp2/cp2/pp2 x 512..4096 tokens (docs/selector.md)
                "activation_scale": {
                    Phase.ROLLOUT: 1.0,
                    Phase.EXPERIENCE: 1.03,
                    Phase.TRAIN: 1.265,
                },
                "fixed_bytes": {
                    Phase.ROLLOUT: 0.0,
                    Phase.EXPERIENCE: -1.45 * MiB,
                    Phase.TRAIN: -1.6 * MiB,
                },
                **overrides,
            }
        )

    def with_calibration(
        self,
        activation_scale: dict[str, float],
        fixed_bytes: dict[str, float],
        layout_fit: dict[str, tuple[float, float]] | None = None,
    ) -> MemorySettings:
        return replace(
            self,
            activation_scale={**self.activation_scale, **activation_scale},
            fixed_bytes={**self.fixed_bytes, **fixed_bytes},
            layout_fit={**self.layout_fit, **(layout_fit or {})},
        )

    def constants(self, phase: str, layout: ParallelLayout) -> tuple[float, float]:
        """(activation scale, fixed bytes) of ``phase`` in ``layout``: the layout's own fit when
        there is one, else the phase's."""
        fitted = self.layout_fit.get(f"{phase}/{layout}")
        if fitted is not None:
            return float(fitted[0]), float(fitted[1])
        return self.activation_scale[phase], self.fixed_bytes[phase]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted peak bytes per rank, by term."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logprob_buffers: float
    kv_cache: float
    overhead: float
    rotary_tables: float = 0.0
    """RoPE tables: Megatron's rotary forward caches up to ``ROTARY_LRU_ENTRIES`` fp32 tables
    (one per distinct packed length, kept across steps) and YaRN its cos/sin; the embedded
    engine's cos/sin tables in the rollout phase."""

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logprob_buffers
            + self.kv_cache
            + self.overhead
            + self.rotary_tables
        )

    @property
    def static(self) -> float:
        """State living across phases: weights, gradients, optimizer."""
        return self.weights + self.gradients + self.optimizer

    def as_dict(self) -> dict[str, float]:
        names = ("weights", "gradients", "optimizer", "activations", "logprob_buffers")
        out = {k: getattr(self, k) for k in (*names, "kv_cache", "overhead", "rotary_tables")}
        out["total"] = self.total
        return out


class MemoryModel:
    """Analytic per-rank peak memory of a phase in a layout (module docstring)."""

    def __init__(self, model: ModelConfig, settings: MemorySettings | None = None) -> None:
        self.model = model
        self.settings = settings or MemorySettings.gpu()
        self.param_bytes = _DTYPE_BYTES[model.params_dtype]

    # ------------------------------------------------------------------ parameters

    def layer_parameters(self, tp: int) -> float:
        """Parameters of one transformer layer on one TP rank."""
        m = self.model
        h, f, d = m.hidden_size, m.ffn_hidden_size, m.head_dim
        qkv_out = (m.num_attention_heads + 2 * m.query_groups) * d
        split = h * qkv_out + m.num_attention_heads * d * h + 3 * h * f
        split += qkv_out if m.add_qkv_bias else 0
        replicated = 2 * h + (2 * d if m.qk_layernorm else 0)
        return split / tp + replicated

    def stage_parameters(self, layout: ParallelLayout) -> float:
        """Parameters on the most loaded pipeline stage's rank."""
        m = self.model
        layers = self.layer_parameters(layout.tp) * m.num_layers / layout.pp
        vocab = m.padded_vocab_size * m.hidden_size / layout.tp
        if layout.pp == 1:
            return layers + vocab * (1 if m.tie_embeddings else 2) + m.hidden_size
        # first stage: embedding; last stage: output layer (+ tied copy) and the final norm
        return layers + vocab + m.hidden_size

    # ------------------------------------------------------------------ activations

    def activation_elements_per_token(
        self, tp: int, recompute: str | None = None, cp: int = 1
    ) -> float:
        """Elements one layer saves for backward per local token on a TP rank."""
        m = self.model
        h, f = m.hidden_size, m.ffn_hidden_size
        q = m.num_attention_heads * m.head_dim
        kv = m.query_groups * m.head_dim
        # input and output of both RMSNorms: replicated over TP, or 1/tp of the sequence each
        # under sequence parallelism (the projections save their un-gathered input and gather
        # it again in backward, as Megatron's linear layers do)
        norms = 4 * h / sequence_parallel_size(m, tp)
        qkv = q + 2 * kv  # fused QKV output
        rotated = q + kv
        # CP all-gathers K/V of the whole sequence (cp x the local tokens), then GQA repeats them
        gathered = 2 * kv * cp if cp > 1 else 0
        expanded = 2 * q * cp if m.query_groups != m.num_attention_heads else 0
        rotated += gathered
        core = q + q  # attention output and its contiguous copy fed to linear_proj
        mlp = 4 * f  # fc1 output (2f), silu(gate), silu(gate) * up
        if recompute == "selective":
            return norms + (qkv + q + mlp) / tp
        return norms + (qkv + rotated + expanded + core + mlp) / tp

    def _layer_transient(self, tp: int, cp: int = 1) -> float:
        """Elements per local token alive inside one layer's forward (forward-only phases): the
        residual stream and norm output, plus the larger of attention (QKV, rotated Q/K, K/V
        gathered over CP and GQA-expanded, output) and SwiGLU (fc1 out, silu, product)."""
        m = self.model
        q = m.num_attention_heads * m.head_dim
        kv = m.query_groups * m.head_dim
        attn = (q + 2 * kv) + (q + kv) + (2 * kv * cp if cp > 1 else 0) + q
        attn += 2 * q * cp if m.query_groups != m.num_attention_heads else 0
        sp = sequence_parallel_size(m, tp)
        # under sequence parallelism: 1/tp of the residual and norm output, plus the gathered
        # input of the projections
        stream = 2 * m.hidden_size if sp == 1 else 2 * m.hidden_size / sp + m.hidden_size
        return stream + max(attn, 4 * m.ffn_hidden_size) / tp

    def saved_activation_bytes(
        self, phase: str, layout: ParallelLayout, work: PhaseWorkload, stage: str = "last"
    ) -> float:
        """Analytic activation bytes before the fitted ``activation_scale`` (no CP masks) on the
        "first" or "last" pipeline stage (the same stage when pp = 1)."""
        m, s = self.model, self.settings
        tokens = math.ceil(work.tokens_per_micro_batch / layout.cp)  # this rank's share
        layers = m.num_layers / layout.pp
        if phase == Phase.TRAIN:
            per_layer = self.activation_elements_per_token(layout.tp, s.recompute, layout.cp)
            # 1F1B: the first stage holds min(pp, micro-batches) in flight, the last stage one
            in_flight = min(layout.pp, work.num_micro_batches) if stage == "first" else 1
            if s.recompute == "full":  # layer inputs of every micro-batch in flight + one layer
                inputs = m.hidden_size / sequence_parallel_size(m, layout.tp)
                saved = layers * inputs * in_flight + per_layer
            else:
                saved = layers * per_layer * in_flight
            elements = (saved + 3 * m.hidden_size) * tokens
        elif phase == Phase.EXPERIENCE:  # + the final hidden states kept for the chunked head
            extra = 2 * m.hidden_size if stage == "last" else m.hidden_size
            elements = (self._layer_transient(layout.tp, layout.cp) + extra) * tokens
        else:  # rollout: prefill of one sequence at a time, then decode
            elements = self._layer_transient(layout.tp) * work.max_seq_len
        return elements * self.param_bytes

    def cp_mask_bytes(self, phase: str, layout: ParallelLayout, work: PhaseWorkload) -> float:
        """Causal masks of this project's CP attention: (2cp + 1) (s / 2cp)^2 elements per
        sequence and layer (kept for backward in training; one layer at a time otherwise)."""
        s = self.settings
        if layout.cp == 1 or phase == Phase.ROLLOUT or not s.cp_mask_bytes:
            return 0.0
        chunk = work.max_seq_len / (2 * layout.cp)
        per_seq = (2 * layout.cp + 1) * chunk * chunk * s.cp_mask_bytes
        seqs = max(1, work.tokens_per_micro_batch // work.max_seq_len)
        layers = self.model.num_layers / layout.pp if phase == Phase.TRAIN else 1
        return per_seq * layers * seqs

    def activations(
        self, phase: str, layout: ParallelLayout, work: PhaseWorkload, stage: str = "last"
    ) -> float:
        scale = self.settings.constants(phase, layout)[0]
        saved = self.saved_activation_bytes(phase, layout, work, stage)
        return scale * saved + self.cp_mask_bytes(phase, layout, work)

    def logprob_buffers(self, phase: str, layout: ParallelLayout, work: PhaseWorkload) -> float:
        """The chunked output layer's buffers plus the fitted fixed bytes; a (phase, layout) fit
        absorbs the buffers into its linear fit (``calibrate.fit``), leaving the fixed bytes."""
        fixed = self.settings.constants(phase, layout)[1]
        if f"{phase}/{layout}" in self.settings.layout_fit:
            return fixed
        return self.chunk_buffer_bytes(phase, layout, work) + fixed

    def peak_stage(
        self, phase: str, layout: ParallelLayout, work: PhaseWorkload, buffers: bool = True
    ) -> str:
        """The pipeline stage holding the peak, from the analytic terms (no fitted constant):
        "last" (log-prob buffers, one micro-batch) unless pp > 1 and the first stage's
        micro-batches in flight outweigh it. ``buffers=False`` compares activations only (a
        (phase, layout) fit absorbs the buffers into its linear term)."""
        if layout.pp == 1:
            return "last"
        first = self.saved_activation_bytes(phase, layout, work, "first")
        last = self.saved_activation_bytes(phase, layout, work, "last")
        if buffers:
            last += self.chunk_buffer_bytes(phase, layout, work)
        return "first" if first > last else "last"

    def chunk_buffer_bytes(self, phase: str, layout: ParallelLayout, work: PhaseWorkload) -> float:
        """The chunked output layer's fp32 ``chunk x V/tp`` buffers (no fitted constant)."""
        s = self.settings
        vocab = self.model.padded_vocab_size / layout.tp
        if phase == Phase.ROLLOUT:  # next-token logits of the decoding batch
            chunk = work.concurrent_sequences
        else:
            chunk = min(s.logprob_chunk_size, math.ceil(work.tokens_per_micro_batch / layout.cp))
        buffers = s.logprob_buffers if phase == Phase.TRAIN else s.logprob_buffers / 2
        return chunk * vocab * 4 * buffers

    def rotary_tables(self, phase: str, work: PhaseWorkload) -> float:
        """RoPE table bytes per rank (not split by any axis): in train/experience, Megatron's
        ``RotaryEmbedding.forward`` LRU cache (``settings.rotary_cache_entries`` entries of ``[s,
        head dim]`` fp32 at most, s up to the longest sequence; with ``rope_type: yarn`` also its
        cos/sin cache); in rollout the engine's cos and sin ``[s, head dim]``, and with a
        ``reserved_kv`` engine (the embedded one) over its whole context, plus the fp32 table
        they are computed from, which Megatron's rotary LRU cache keeps."""
        m, s = self.model, work.max_seq_len
        if phase == Phase.ROLLOUT:
            if work.reserved_kv is not None:
                context = work.reserved_kv.context
                return context * m.head_dim * (2 * self.param_bytes + 4)
            return 2 * s * m.head_dim * self.param_bytes
        tables = self.settings.rotary_cache_entries * s * m.head_dim * 4
        if m.rope_type == "yarn":
            tables += 2 * s * m.head_dim * self.param_bytes
        return tables

    def kv_row_bytes(self, layout: ParallelLayout, tokens: int) -> float:
        """KV-cache bytes per rank of ``tokens`` positions of one sequence (every layer of the
        stage, keys and values, the rank's KV heads and share of the sequence)."""
        m = self.model
        kv_heads = max(1.0, m.query_groups / layout.tp)
        per_token = 2 * kv_heads * m.head_dim * self.param_bytes
        return m.num_layers / layout.pp * per_token * tokens / layout.cp

    def kv_cache(
        self, layout: ParallelLayout, work: PhaseWorkload, static_bytes: float = 0.0
    ) -> float:
        """KV-cache bytes per rank of a rollout engine replica: its reserved rows x context
        (``work.reserved_kv``: allocated whole, whatever the lengths; the rows its budget holds
        next to ``static_bytes`` of weights and train state), else the concurrent sequences x
        the longest."""
        reserved = work.reserved_kv
        if reserved is None:
            return self.kv_row_bytes(layout, work.concurrent_sequences * work.max_seq_len)
        row = self.kv_row_bytes(layout, reserved.context)
        return reserved.rows_for(row, static_bytes) * row

    # ------------------------------------------------------------------ total

    def train_state(self, layout: ParallelLayout) -> tuple[float, float, float]:
        """(weights, gradients, optimizer) bytes of the trainable master copy in ``layout``."""
        s = self.settings
        params = self.stage_parameters(layout)
        master = 0 if self.param_bytes == 4 else 4
        optim = params * (8 + master)
        if s.use_distributed_optimizer:  # Megatron shards over the dp x cp group
            optim /= layout.dp * layout.cp
        return params * self.param_bytes, params * s.grad_bytes, optim

    def peak(
        self,
        phase: str,
        layout: ParallelLayout,
        work: PhaseWorkload,
        train_layout: ParallelLayout | None = None,
    ) -> MemoryBreakdown:
        """Predicted peak bytes on the most loaded rank of ``layout`` for ``phase``.

        ``train_layout``: where the trainable master copy (weights, gradients, optimizer state)
        lives while a rollout/experience phase runs in ``layout`` (the RL loop keeps one master
        and a weights-only copy per other layout); None: in ``layout`` itself. The train phase
        always holds the master in its own layout."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        s = self.settings
        home = layout if phase == Phase.TRAIN or train_layout is None else train_layout
        weights = self.stage_parameters(layout) * self.param_bytes
        grads = optim = 0.0
        if phase == Phase.TRAIN or s.train_state_resident:
            master_weights, grads, optim = self.train_state(home)
            if home != layout:  # the phase's own copy next to the master
                weights += master_weights
        # The last stage adds the log-prob buffers; the first holds more micro-batches (1F1B).
        fitted = f"{phase}/{layout}" in s.layout_fit
        stage = self.peak_stage(phase, layout, work, buffers=not fitted)
        activations = self.activations(phase, layout, work, stage)
        buffers = self.logprob_buffers(phase, layout, work)
        if stage == "first":  # no output layer there: only the fitted fixed bytes
            buffers = self.settings.constants(phase, layout)[1]
        buffers = max(buffers, -activations)  # a fitted negative constant never eats the state
        return MemoryBreakdown(
            weights=weights,
            gradients=grads,
            optimizer=optim,
            activations=activations,
            logprob_buffers=buffers,
            kv_cache=(
                self.kv_cache(layout, work, weights + grads + optim)
                if phase == Phase.ROLLOUT
                else 0.0
            ),
            overhead=s.overhead_bytes,
            rotary_tables=self.rotary_tables(phase, work),
        )
