"""``serve``'s ``--model-path`` / ``--tokenizer-path`` resolution (``rollout/serve/model.py``):
which tokenizer codes text, which eos ids stop, and the start-up errors (each naming the value
and what would be valid). The served generation itself: tests/integration/test_serve_hf.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert.convert import export_hf
from megatron_earl.models.hf_mapping import global_shapes
from megatron_earl.rollout.serve.model import ByteCodec, HFCodec, ModelPathError, resolve_model
from megatron_earl.rollout.weights.sync import hf_named_tensors

pytest.importorskip("transformers")
from megatron_earl.tokenizer.demo_hf import demo_hf_tokenizer

MODEL = ModelConfig(
    num_layers=1,
    hidden_size=16,
    ffn_hidden_size=32,
    num_attention_heads=2,
    vocab_size=320,
    make_vocab_size_divisible_by=64,
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_model")
    full = {k: torch.zeros(s) for k, s in global_shapes(MODEL).items()}
    export_hf(hf_named_tensors(full, MODEL), MODEL, tmp / "bare")
    demo_hf_tokenizer().save_pretrained(tmp / "tok")
    torch.save(full, tmp / "w.pt")
    (tmp / "model.json").write_text(json.dumps(MODEL.to_dict()))
    return tmp


def test_an_hf_directory_without_a_tokenizer_keeps_the_byte_stand_in(dirs):
    served = resolve_model(str(dirs / "bare"))
    assert served.kind == "hf" and served.model_config.num_layers == 1
    assert isinstance(served.codec, ByteCodec) and served.codec.path is None
    assert served.eos_token_ids == ()


def test_tokenizer_path_overrides_and_brings_its_eos(dirs):
    served = resolve_model(str(dirs / "w.pt"), str(dirs / "model.json"), str(dirs / "tok"))
    assert served.kind == "full_state" and isinstance(served.codec, HFCodec)
    assert served.codec.path == str(dirs / "tok")
    assert served.eos_token_ids == (3,)  # the demo tokenizer's <|im_end|>
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = served.codec.encode(text)
    assert served.codec.decode(ids, skip_special_tokens=False) == text
    assert served.codec.decode(ids) == "user\nhi"


def test_start_up_errors_name_the_value(dirs):
    with pytest.raises(ModelPathError, match=r"--model-config .* with the HF directory"):
        resolve_model(str(dirs / "bare"), str(dirs / "model.json"))
    with pytest.raises(ModelPathError, match="does not exist; give an HF directory"):
        resolve_model(str(dirs / "missing"))
    with pytest.raises(ModelPathError, match="cannot load a tokenizer from"):
        resolve_model("random", None, str(dirs / "bare"))
    small = dirs / "small.json"
    small.write_text(json.dumps({**MODEL.to_dict(), "vocab_size": 100}))
    with pytest.raises(ModelPathError, match="has 320 ids, more than the model's vocabulary"):
        resolve_model("random", str(small), str(dirs / "tok"))


def test_a_bad_model_path_is_refused_before_megatron_core_is_imported(tmp_path):
    # a fresh process, as `megatron-earl serve` runs: exit 2 naming the path, without paying
    # megatron-core's import (the engine is imported once the model path is resolved)
    code = (
        "import sys\n"
        "from megatron_earl.rollout.serve import server\n"
        f"rc = server.main(['--model-path', {str(tmp_path / 'missing')!r}, '--port', '0'])\n"
        "print(rc, 'megatron.core' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split("\n")[-2] == "2 False", (done.stdout, done.stderr[-2000:])
    assert "does not exist; give an HF directory" in done.stderr
