"""HF <-> Megatron conversion of mixtures of experts on tiny random models made with transformers'
own classes: Qwen3-MoE (``Qwen3MoeForCausalLM``: q/k norm, head_dim 32 != hidden/heads, 4 experts
of width 32, top-2 renormalised) and Mixtral (``MixtralForCausalLM``: 4 experts of width 48,
top-2), 2 layers, hidden 64, every parameter random:

- the converted checkpoint's logits equal transformers' within the fp32 bound of a forward's
  chain of sums (``tests/tolerances.py``) at EP1 (tp1dp2), EP2 (tp1dp2ep2: two experts per rank,
  tokens exchanged by megatron-core's all-to-all) and tp2ep2etp1 (sequence parallel), loaded
  through ``dist_checkpointing`` and directly from the HF directory;
- HF -> mcore -> HF is bitwise (every tensor, dtype, the config) and loads in transformers with
  identical logits; each checkpoint read asks for one layer;
- a training checkpoint saved at EP2 (each rank holding half the experts) exports to HF bitwise.

The routing decision is discrete: were a token's k-th and (k+1)-th router logits closer than
their rounding, the two implementations could pick different experts whatever the conversion.
``test_logits_match_transformers`` checks the smallest such gap of the test tokens is above twice
the forward's fp32 bound (``SEED``), so the comparison measures the mapping alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_convert import _hf_logits, _megatron_logits, _tokens
from tests.tolerances import assert_fp32_close, fp32_tol, gpt_terms

FAMILIES = ("qwen3_moe", "mixtral")
SEED = 2
"""The tiny models' weights: their smallest router gap on the test tokens (module docstring) is
40x (Qwen3-MoE) and 13x (Mixtral) twice the forward's bound; seed 0's Qwen3-MoE is 1.1x."""
LAYOUTS = {
    "ep1": ParallelLayout(dp=2),
    "ep2": ParallelLayout(dp=2, ep=2),
    "tp2ep2etp1": ParallelLayout(tp=2, ep=2, etp=1),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from megatron_earl.convert.convert import hf_to_mcore
    from megatron_earl.convert.tiny import save_tiny_hf

    root = tmp_path_factory.mktemp("convert_moe")
    cases = {}
    for family in FAMILIES:
        hf_dir = save_tiny_hf(family, root / f"hf-{family}", seed=SEED)
        mcore_dir = root / f"mcore-{family}"
        hf_to_mcore(hf_dir, mcore_dir, tp=2, ep=2, etp=1, make_vocab_size_divisible_by=16)
        cases[family] = (str(mcore_dir), str(hf_dir))
    return cases


def _logits_in_layouts(cases: dict, tokens: torch.Tensor, run_root: str):
    """Every rank: each converted model in each layout, from the checkpoint and from HF; the
    logits of TP/CP rank 0. At EP2 the model loaded from HF is also saved as a training
    checkpoint (every rank writes its own experts)."""
    from megatron.core import parallel_state

    from megatron_earl import runtime
    from megatron_earl.config.model import ModelConfig
    from megatron_earl.config.run import CheckpointConfig
    from megatron_earl.convert.dcp import COMMON_KEY, load_common
    from megatron_earl.convert.initial import load_initial_weights
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.training.checkpoint import save_checkpoint

    out = {}
    for family, (mcore_dir, hf_dir) in cases.items():
        stored = ModelConfig(**load_common(mcore_dir)[COMMON_KEY]["model_config"])
        model = dataclasses.replace(stored, sequence_parallel=True)  # MoE at tp 2 needs it
        for lname, layout in LAYOUTS.items():
            use_layout(layout)
            for source, path in (("mcore", mcore_dir), ("hf", hf_dir)):
                runtime.seed(5)
                chunks = build_model(model)
                assert load_initial_weights(chunks, path) == source
                logits = _megatron_logits(chunks, tokens)
                if parallel_state.get_tensor_model_parallel_rank() == 0:
                    out[(family, lname, source)] = logits
                if (lname, source) == ("ep2", "hf"):
                    local = parallel_state.get_expert_model_parallel_world_size()
                    out[(family, "local_experts")] = len(
                        chunks[0].decoder.layers[0].mlp.experts.local_experts
                    )
                    assert local == 2
                    save_checkpoint(
                        CheckpointConfig(dir=f"{run_root}/run-{family}"),
                        3,
                        chunks,
                        model_config=stored,
                        family=family,
                    )
    return out


def _router_gap(hf_dir: str) -> tuple[float, float]:
    """(smallest gap between a token's k-th and (k+1)-th router logit, largest |router logit|)
    over every MoE layer of transformers' forward of the test tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    logits = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: logits.append(out[0]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(_tokens())
    for hook in hooks:
        hook.remove()
    top = torch.cat(logits).topk(k + 1, dim=-1).values
    return float((top[:, k - 1] - top[:, k]).min()), float(torch.cat(logits).abs().max())


@pytest.fixture(scope="module")
def megatron_results(converted, tmp_path_factory):
    run_root = tmp_path_factory.mktemp("moe_runs")
    results = run_distributed(
        _logits_in_layouts, 2, args=(converted, _tokens(), str(run_root)), timeout_s=900
    )
    got: dict = {}
    for res in results:
        got.update(res)
    return got, run_root


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(converted, megatron_results, family):
    from transformers import AutoConfig

    from megatron_earl.convert.tiny import tiny_model_config

    got, _ = megatron_results
    _, hf_dir = converted[family]
    assert type(AutoConfig.from_pretrained(hf_dir)).__name__ in ("Qwen3MoeConfig", "MixtralConfig")
    ref = _hf_logits(hf_dir)
    # The forward's chain of sums, experts included (router, its softmax, an expert's fc1 and
    # fc2, the top-k combine): 2 x 1.3e3 (Mixtral) / 1.6e3 (Qwen3-MoE) terms x u = 1.6e-4 /
    # 1.9e-4 x max |logit| (~1e-3 here; 2e-6 to 7e-6 observed). HF renormalises the
    # top-k of a softmax over all experts, megatron-core takes a softmax over the top-k logits:
    # the same values up to a few roundings. A wrong expert, gate/up swap or routing rule moves
    # logits by O(1).
    terms = gpt_terms(tiny_model_config(family), _tokens().size(1))
    # each of the two logits deciding a token's last expert moves by at most the bound (the whole
    # forward's, an overestimate for a router logit): a gap above twice it cannot flip the choice
    gap, router_max = _router_gap(hf_dir)
    assert gap > 2 * fp32_tol(terms, router_max), (gap, router_max)
    for layout in LAYOUTS:
        for source in ("mcore", "hf"):
            logits = got[(family, layout, source)][..., : ref.shape[-1]]
            assert_fp32_close(logits, ref, terms, msg=f"{family} {layout} from {source}")
    assert got[(family, "local_experts")] == 2


def _export(cases: dict, out_root: str, run_root: str):
    """One rank (a world of one): each converted checkpoint -> HF (recording the layers each
    checkpoint read asked for), and each EP2 training checkpoint -> HF without --hf-config."""
    from megatron_earl.convert import convert
    from megatron_earl.training.checkpoint import resolve_checkpoint

    reads = []
    original = convert.load_slices

    def spy(ckpt, requests):
        reads.append(sorted({str(layer) for _, _, layer in requests.values()}))
        return original(ckpt, requests)

    convert.load_slices = spy
    paths = {}
    try:
        for family, (mcore_dir, hf_dir) in cases.items():
            out = f"{out_root}/back-{family}"
            convert.mcore_to_hf(mcore_dir, out, hf_config_dir=hf_dir, max_shard_bytes=40_000)
            paths[family] = out
            out = f"{out_root}/training-{family}"
            convert.mcore_to_hf(resolve_checkpoint(f"{run_root}/run-{family}"), out)
            paths[f"training-{family}"] = out
    finally:
        convert.load_slices = original
    return paths, reads


def test_round_trip_is_bitwise(converted, megatron_results, tmp_path):
    from megatron_earl.convert.families import model_config_from_hf, read_hf_config
    from megatron_earl.convert.hf_io import HFReader

    _, run_root = megatron_results
    results = run_distributed(
        _export, 1, args=(converted, str(tmp_path), str(run_root)), timeout_s=300
    )
    paths, reads = results[0]
    assert reads and all(len(layers) == 1 for layers in reads), reads  # one layer per read
    for family, (_, hf_dir) in converted.items():
        src = HFReader(hf_dir)
        a = src.read(sorted(src.names()))
        assert any(".experts.3." in name for name in a)
        for name in (family, f"training-{family}"):
            back = HFReader(paths[name])
            assert src.names() == back.names(), name
            b = back.read(sorted(back.names()))
            for n in a:
                assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), (name, n)
            assert model_config_from_hf(read_hf_config(paths[name])) == model_config_from_hf(
                read_hf_config(hf_dir)
            ), name
        assert len(set(HFReader(paths[family]).weight_map.values())) > 1  # sharded output
        torch.testing.assert_close(_hf_logits(paths[family]), _hf_logits(hf_dir), rtol=0, atol=0)
