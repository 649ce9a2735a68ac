"""Memory model and throughput table: terms checked against hand-computed numbers (exact), the
monotonic behaviour of each parallel axis, and the calibration fit on synthetic points."""

from __future__ import annotations

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.calibrate import CalibrationPoint, errors, fit
from megatron_earl.selector.memory import MemoryModel, MemorySettings, PhaseWorkload
from megatron_earl.selector.plan_cli import KNOWN_MODELS
from megatron_earl.selector.throughput import HardwareSpec, Roofline, ThroughputTable, bucket_of

TINY = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=1024,
    make_vocab_size_divisible_by=64,
)


def test_parameters_match_model_config_count():
    for model in [TINY, *KNOWN_MODELS.values()]:
        mem = MemoryModel(model)
        assert mem.stage_parameters(ParallelLayout()) == pytest.approx(model.num_parameters())


def test_qwen_shapes_and_parameter_counts():
    assert KNOWN_MODELS["qwen2.5-7b"].num_parameters() == pytest.approx(7.62e9, rel=0.01)
    assert KNOWN_MODELS["qwen2.5-72b"].num_parameters() == pytest.approx(72.7e9, rel=0.01)


def test_static_terms_by_hand():
    """7B in bf16 at tp4 pp2 dp4, distributed optimizer: every static term by hand."""
    model = KNOWN_MODELS["qwen2.5-7b"]
    mem = MemoryModel(model, MemorySettings.gpu(overhead_bytes=0.0))
    layout = ParallelLayout(tp=4, pp=2, dp=4)
    h, f, d, v = 3584, 18944, 128, 152064
    qkv = (28 + 2 * 4) * d
    layer = (h * qkv + 28 * d * h + 3 * h * f + qkv) / 4 + 2 * h
    stage = 14 * layer + v * h / 4 + h
    work = PhaseWorkload("train", 4096, 4096)
    out = mem.peak("train", layout, work)
    assert out.weights == pytest.approx(stage * 2)
    assert out.gradients == pytest.approx(stage * 4)
    assert out.optimizer == pytest.approx(stage * 12 / 4)  # master + 2 moments, over dp x cp


def test_activation_and_kv_by_hand():
    """Tiny fp32 model, tp1 cp1 pp1: activations, chunk buffers and KV cache by hand."""
    settings = MemorySettings.gpu(overhead_bytes=0.0, logprob_chunk_size=256)
    mem = MemoryModel(TINY, settings)
    layout = ParallelLayout()
    work = PhaseWorkload("train", 1000, 1000)
    # per layer: norms 4h + qkv (q + 2kv) + rotated (q + kv) + expanded 2q + core 2q + mlp 4f
    per_layer = 4 * 64 + (128 + 96 + 128 + 128 + 1024)
    expected = (2 * per_layer + 3 * 64) * 1000 * 4
    assert mem.activations("train", layout, work) == pytest.approx(expected)
    assert mem.logprob_buffers("train", layout, work) == pytest.approx(256 * 1024 * 4 * 4)
    rollout = PhaseWorkload("rollout", 1000, 1000, concurrent_sequences=8)
    kv = 2 * 2 * 2 * 16 * 8000 * 4  # layers x (k, v) x kv heads x head dim x tokens x fp32
    assert mem.kv_cache(ParallelLayout(), rollout) == pytest.approx(kv)
    assert mem.kv_cache(ParallelLayout(tp=2), rollout) == pytest.approx(kv / 2)


def test_sequence_parallel_splits_the_norm_activations_by_hand():
    """model.sequence_parallel at tp2: the norms' 4h saved elements per token become 4h/2 (the
    rest is unchanged); at tp1 nothing changes (sequence parallelism is off there)."""
    import dataclasses

    settings = MemorySettings.gpu(overhead_bytes=0.0)
    plain, split = (
        MemoryModel(dataclasses.replace(TINY, sequence_parallel=sp), settings)
        for sp in (False, True)
    )
    work = PhaseWorkload("train", 1000, 1000)
    tp2 = ParallelLayout(tp=2)
    saved = plain.activations("train", tp2, work) - split.activations("train", tp2, work)
    assert saved == pytest.approx(2 * (4 * 64 / 2) * 1000 * 4)  # layers x 2h x tokens x fp32
    one = ParallelLayout()
    assert split.activations("train", one, work) == plain.activations("train", one, work)
    # forward only: 2h/tp of residual and norm output + the gathered h, so less from tp 4 on
    exp, tp4 = PhaseWorkload("experience", 1000, 1000), ParallelLayout(tp=4)
    assert split.activations("experience", tp2, exp) == plain.activations("experience", tp2, exp)
    saved = plain.activations("experience", tp4, exp) - split.activations("experience", tp4, exp)
    assert saved == pytest.approx((2 * 64 - (2 * 64 / 4 + 64)) * 1000 * 4)


def test_axes_reduce_memory_where_they_should():
    model = KNOWN_MODELS["qwen2.5-7b"]
    mem = MemoryModel(model, MemorySettings.gpu())
    work = PhaseWorkload("train", 65536, 65536, num_micro_batches=8)
    base = mem.peak("train", ParallelLayout(dp=8), work)
    for axis in ("tp", "cp"):
        split = mem.peak("train", ParallelLayout(**{axis: 2}, dp=4), work)
        assert split.activations < base.activations
        assert split.total < base.total
    assert mem.peak("train", ParallelLayout(pp=2, dp=4), work).weights < base.weights
    full = MemoryModel(model, MemorySettings.gpu(recompute="full"))
    assert full.peak("train", ParallelLayout(dp=8), work).activations < base.activations / 5
    # forward-only phases keep no activations and no optimizer state
    exp = mem.peak("experience", ParallelLayout(dp=8), PhaseWorkload("experience", 65536, 65536))
    assert exp.optimizer == exp.gradients == 0 and exp.activations < base.activations / 10


def test_workload_from_lengths():
    work = PhaseWorkload.for_lengths("train", [100, 3000, 5000], token_budget=4096, dp=2)
    assert work.max_seq_len == 5000 and work.tokens_per_micro_batch == 5000
    assert work.num_micro_batches == 1 and work.concurrent_sequences == 2
    with pytest.raises(ValueError, match="never split"):
        PhaseWorkload("train", 5000, 4096)
    with pytest.raises(ValueError, match="phase"):
        PhaseWorkload("decode", 1, 1)


def test_calibration_fit_recovers_constants():
    """Points generated from known constants: the fit returns them and the error vanishes."""
    truth = MemoryModel(TINY, MemorySettings.cpu().with_calibration({"train": 1.5}, {"train": 1e6}))
    points = []
    for layout in (ParallelLayout(dp=2), ParallelLayout(tp=2), ParallelLayout(cp=2)):
        for n in (512, 2048):
            lengths = (n, n)
            work = PhaseWorkload.for_lengths("train", lengths, token_budget=256, dp=layout.dp)
            peak = truth.peak("train", layout, work).total
            points.append(CalibrationPoint("train", str(layout), lengths, 256, int(peak), 0))
    fitted = fit(MemoryModel(TINY, MemorySettings.cpu()), points)
    assert fitted.activation_scale["train"] == pytest.approx(1.5, rel=1e-3)
    assert fitted.fixed_bytes["train"] == pytest.approx(1e6, rel=1e-2)
    assert max(abs(e.relative) for e in errors(MemoryModel(TINY, fitted), points)) < 1e-3


def test_throughput_table_ema_and_fallback():
    roofline = Roofline(TINY, HardwareSpec.cpu())
    table = ThroughputTable(roofline, ema=0.5)
    dp2, tp2 = ParallelLayout(dp=2), ParallelLayout(tp=2)
    assert bucket_of(3000) == 4096 and bucket_of(10) == 256
    assert table.predict("train", dp2, 1000)[1] == "roofline"
    table.record("train", dp2, 1000, tokens=1000, seconds=1.0)
    table.record("train", dp2, 900, tokens=3000, seconds=1.0)
    assert table.predict("train", dp2, 1024) == (2000.0, "measured")
    # an unmeasured cell: the roofline scaled by measured / roofline of the measured cells
    scale = 2000.0 / roofline.tokens_per_s("train", dp2, 1024)
    value, source = table.predict("train", tp2, 1024)
    assert source == "roofline"
    assert value == pytest.approx(roofline.tokens_per_s("train", tp2, 1024) * scale)
    assert value < 2000.0  # tp pays its communication in the roofline


def test_roofline_prefers_less_parallelism_when_it_fits():
    roofline = Roofline(KNOWN_MODELS["qwen2.5-7b"], HardwareSpec.h100())
    fast = roofline.tokens_per_s("train", ParallelLayout(dp=8), 4096)
    assert fast > roofline.tokens_per_s("train", ParallelLayout(tp=8), 4096)
    assert fast > roofline.tokens_per_s("train", ParallelLayout(pp=8), 4096)
    assert roofline.tokens_per_s("train", ParallelLayout(dp=8), 65536) < fast


def test_rotary_tables_by_hand():
    """Megatron's rotary LRU cache (32 fp32 tables of [s, head dim]) in train/experience, plus
    YaRN's cos/sin; the engine's cos/sin in rollout; counted in the total, not split by tp."""
    import dataclasses

    from megatron_earl.selector.memory import ROTARY_LRU_ENTRIES

    settings = MemorySettings.gpu(overhead_bytes=0.0)
    work = PhaseWorkload("train", 4096, 4096)
    plain = MemoryModel(TINY, settings)
    yarn = MemoryModel(
        dataclasses.replace(
            TINY,
            rope_type="yarn",
            rope_scaling_factor=4.0,
            rope_original_max_position_embeddings=1024,
        ),
        settings,
    )
    lru = ROTARY_LRU_ENTRIES * 4096 * 16 * 4
    for layout in (ParallelLayout(), ParallelLayout(tp=2)):
        peak = plain.peak("train", layout, work)
        assert peak.rotary_tables == lru
        assert peak.total == pytest.approx(
            sum(v for k, v in peak.as_dict().items() if k != "total")
        )
        assert yarn.peak("train", layout, work).rotary_tables == lru + 2 * 4096 * 16 * 4
    rollout = PhaseWorkload("rollout", 4096, 4096, concurrent_sequences=2)
    assert plain.peak("rollout", ParallelLayout(), rollout).rotary_tables == 2 * 4096 * 16 * 4


def test_reserved_kv_cache_is_rows_times_context_whatever_the_lengths():
    """The embedded engine allocates its row cache whole when it is built: every row holds the
    context limit, whatever the batch, and the RoPE tables span it (cos, sin and Megatron's
    cached fp32 table); TP splits the KV groups, not the rows."""
    from megatron_earl.selector.memory import ReservedKV

    mem = MemoryModel(TINY, MemorySettings.gpu(overhead_bytes=0.0))
    reserved = ReservedKV(rows=64, context=100_000)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv groups x head dim x fp32
    for lengths in ([1] * 8, [100_000] + [1] * 7, [300] * 8):
        for dp in (1, 2):
            work = PhaseWorkload.for_lengths("rollout", lengths, dp=dp, reserved_kv=reserved)
            peak = mem.peak("rollout", ParallelLayout(dp=dp), work)
            assert peak.kv_cache == 64 * 100_000 * per_token
            assert peak.rotary_tables == 100_000 * 16 * (4 + 4 + 4)
    work = PhaseWorkload.for_lengths("rollout", [300] * 8, reserved_kv=reserved)
    assert mem.kv_cache(ParallelLayout(tp=2), work) == 64 * 100_000 * per_token / 2
    with pytest.raises(ValueError, match="rows"):
        ReservedKV(rows=0, context=10)
