"""HF <-> Megatron conversion on tiny random models of each family (Llama GQA untied, Qwen2 QKV bias
tied, Qwen3 q/k norm with head_dim != hidden/heads) and RoPE variant (Llama 3.x ``llama3`` tied as
3.2 1B/3B, YaRN on Qwen2 and Qwen3, linear interpolation; original contexts of 8 positions, so the
12-token sequence runs past them):

- the converted Megatron checkpoint's logits equal HF's (within the fp32 bound of a forward's sums
  in another order: ``tests/tolerances.py``) at TP1 (DP2), TP2, PP2 and CP2, loaded through
  ``dist_checkpointing`` in each layout and directly from the HF directory
  (``load_initial_weights``);
- HF -> mcore -> HF is bitwise and the output loads in ``transformers``;
- every checkpoint read of mcore -> HF asks for one layer (streaming);
- a training checkpoint (``training/checkpoint.py``, model config + family stored) exports to
  HF without ``--hf-config``, bitwise.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import assert_fp32_close, gpt_terms

CASES = {
    "llama": dict(family="llama", tie=False),
    "qwen2": dict(family="qwen2", tie=True),
    "qwen3": dict(family="qwen3", tie=False),
    "llama3": dict(family="llama", tie=True, rope="llama3"),
    "llama-linear": dict(family="llama", tie=False, rope="linear"),
    "qwen2-yarn": dict(family="qwen2", tie=True, rope="yarn"),
    "qwen3-yarn": dict(family="qwen3", tie=False, rope="yarn"),
}
LAYOUTS = ("dp2", "tp2", "pp2", "cp2")


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(7))


def _hf_logits(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_tokens()).logits


def _gather_logits(logits, batch):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits.float())
    return full.sum() * 0.0, {"logits": full.detach().clone()}


def _megatron_logits(chunks, tokens):
    """Full-sequence logits on the last stage (None elsewhere); under CP each rank runs its share
    and the shares are gathered over the CP group (every CP rank calls)."""
    from megatron.core import parallel_state

    from megatron_earl.parallel.cp import merge_cp_shards, split_batch_for_cp
    from megatron_earl.training.schedule import forward_backward

    batch = {
        "tokens": tokens,
        "position_ids": torch.arange(tokens.size(1)).expand_as(tokens).contiguous(),
    }
    cp = parallel_state.get_context_parallel_world_size()
    batch = split_batch_for_cp(batch, cp, parallel_state.get_context_parallel_rank())
    metrics = forward_backward(chunks, [batch], _gather_logits, forward_only=True)
    if not metrics:
        return None
    logits = metrics[0]["logits"]
    if cp > 1:
        shards = [torch.empty_like(logits) for _ in range(cp)]
        torch.distributed.all_gather(
            shards, logits, group=parallel_state.get_context_parallel_group()
        )
        logits = merge_cp_shards(shards)
    return logits


def _logits_in_layouts(cases: dict, tokens):
    """Every rank: for each converted checkpoint and layout, load and return the logits."""
    from megatron.core import parallel_state

    from megatron_earl import runtime
    from megatron_earl.config.model import ModelConfig
    from megatron_earl.convert.dcp import COMMON_KEY, load_common
    from megatron_earl.convert.initial import load_initial_weights
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import use_layout

    layouts = {
        "dp2": ParallelLayout(dp=2),
        "tp2": ParallelLayout(tp=2),
        "pp2": ParallelLayout(pp=2),
        "cp2": ParallelLayout(cp=2),
    }
    out = {}
    for name, (mcore_dir, hf_dir) in cases.items():
        model = ModelConfig(**load_common(mcore_dir)[COMMON_KEY]["model_config"])
        for lname, layout in layouts.items():
            use_layout(layout)
            for source, path in (("mcore", mcore_dir), ("hf", hf_dir)):
                runtime.seed(5)
                chunks = build_model(model)
                kind = load_initial_weights(chunks, path)
                assert kind == source, (kind, source)
                logits = _megatron_logits(chunks, tokens)
                first = parallel_state.get_tensor_model_parallel_rank() == 0
                first = first and parallel_state.get_context_parallel_rank() == 0
                if logits is not None and first:
                    out[(name, lname, source)] = logits
    return out


def _tiny_kwargs(case: dict) -> dict:
    return {k: v for k, v in case.items() if k != "family"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from megatron_earl.convert.convert import hf_to_mcore
    from megatron_earl.convert.tiny import save_tiny_hf

    root = tmp_path_factory.mktemp("convert")
    cases = {}
    for name, kwargs in CASES.items():
        hf_dir = save_tiny_hf(kwargs["family"], root / f"hf-{name}", **_tiny_kwargs(kwargs))
        hf_to_mcore(hf_dir, root / f"mcore-{name}", tp=2, pp=2, make_vocab_size_divisible_by=16)
        cases[name] = (str(root / f"mcore-{name}"), str(hf_dir))
    return cases


def test_logits_match_hf_in_every_layout(converted):
    from megatron_earl.convert.tiny import tiny_model_config

    results = run_distributed(_logits_in_layouts, 2, args=(converted, _tokens()), timeout_s=900)
    got: dict = {}
    for res in results:
        got.update(res)
    for family, (_, hf_dir) in converted.items():
        ref = _hf_logits(hf_dir)
        case = CASES[family]
        # the forward's chain of sums (HF orders its norms, RoPE and softmax scaling otherwise:
        # a few roundings more per element, well inside it): ~1e-4 x |logit|; a weight mapped
        # to the wrong slot or a RoPE variant off moves logits by O(1)
        model = tiny_model_config(case["family"], **_tiny_kwargs(case))
        terms = gpt_terms(model, _tokens().size(1))
        for layout in LAYOUTS:
            for source in ("mcore", "hf"):
                logits = got[(family, layout, source)][..., : ref.shape[-1]]
                assert_fp32_close(logits, ref, terms, msg=f"{family} {layout} from {source}")


def _round_trip(cases: dict, out_root: str):
    """One rank (a world of one): mcore -> HF for every case, recording what each checkpoint read
    asked for; then a training checkpoint (``save_checkpoint``) of the llama case -> HF."""
    from megatron_earl import runtime
    from megatron_earl.config.model import ModelConfig
    from megatron_earl.config.run import CheckpointConfig
    from megatron_earl.convert import convert
    from megatron_earl.convert.dcp import COMMON_KEY, load_common
    from megatron_earl.convert.initial import load_initial_weights
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.training.checkpoint import save_checkpoint

    reads = []
    original = convert.load_slices

    def spy(ckpt, requests):
        reads.append(sorted({str(layer) for _, _, layer in requests.values()}))
        return original(ckpt, requests)

    convert.load_slices = spy
    paths = {}
    try:
        for family, (mcore_dir, hf_dir) in cases.items():
            out = f"{out_root}/hf-back-{family}"
            convert.mcore_to_hf(mcore_dir, out, hf_config_dir=hf_dir, max_shard_bytes=30_000)
            paths[family] = out
    finally:
        convert.load_slices = original
    mcore_dir, hf_dir = cases["llama"]
    model = ModelConfig(**load_common(mcore_dir)[COMMON_KEY]["model_config"])
    use_layout(ParallelLayout())
    runtime.seed(3)
    chunks = build_model(model)
    load_initial_weights(chunks, hf_dir)
    run_dir = f"{out_root}/run"
    save_checkpoint(CheckpointConfig(dir=run_dir), 5, chunks, model_config=model, family="llama")
    from megatron_earl.training.checkpoint import resolve_checkpoint

    convert.mcore_to_hf(resolve_checkpoint(run_dir), f"{out_root}/hf-from-training")
    paths["training"] = f"{out_root}/hf-from-training"
    return paths, reads


def test_round_trip_is_bitwise_and_loads_in_transformers(converted, tmp_path):
    from megatron_earl.convert.families import model_config_from_hf, read_hf_config
    from megatron_earl.convert.hf_io import HFReader

    results = run_distributed(_round_trip, 1, args=(converted, str(tmp_path)), timeout_s=240)
    paths, reads = results[0]
    # Streaming: every checkpoint read asks for the top-level tensors or for one layer.
    assert reads and all(len(layers) == 1 for layers in reads), reads
    sources = {family: hf_dir for family, (_, hf_dir) in converted.items()}
    sources["training"] = converted["llama"][1]  # the llama model, through save_checkpoint
    for family, hf_dir in sources.items():
        src, back = HFReader(hf_dir), HFReader(paths[family])
        assert src.names() == back.names(), family
        a, b = src.read(sorted(src.names())), back.read(sorted(back.names()))
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (family, name)
        if family != "training":
            assert len(set(back.weight_map.values())) > 1, "expected a sharded output"
        torch.testing.assert_close(_hf_logits(paths[family]), _hf_logits(hf_dir), rtol=0, atol=0)
        src_cfg, back_cfg = read_hf_config(hf_dir), read_hf_config(paths[family])
        assert back_cfg["rope_parameters"] == src_cfg["rope_parameters"], family
        assert model_config_from_hf(back_cfg) == model_config_from_hf(src_cfg), family


def test_script_exports_to_hf(converted, tmp_path):
    """``scripts/convert_mcore_to_hf.sh`` in a fresh process (it joins its own world of one);
    the hf -> mcore wrapper runs the same ``cli.main`` (tested in tests/unit/test_convert.py)."""
    import subprocess
    import sys
    from pathlib import Path

    from megatron_earl.convert.hf_io import HFReader

    root = Path(__file__).resolve().parents[2]
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    mcore_dir, hf_dir = converted["qwen2"]
    usage = subprocess.run(
        ["bash", root / "scripts/convert_hf_to_mcore.sh"], env=env, capture_output=True, text=True
    )
    assert usage.returncode == 2 and "usage:" in usage.stderr
    proc = subprocess.run(
        ["bash", root / "scripts/convert_mcore_to_hf.sh", mcore_dir, tmp_path / "h",
         "--hf-config", hf_dir],
        env=env, cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    src, back = HFReader(hf_dir), HFReader(tmp_path / "h")
    a, b = src.read(sorted(src.names())), back.read(sorted(back.names()))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert (tmp_path / "h" / "generation_config.json").is_file()  # copied from --hf-config
