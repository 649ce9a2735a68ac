"""The HF directory an inference engine (SGLang, ``megatron-earl serve``) starts from for a run.

    write_engine_model(model, "demo", "runs/engine_model")     # or an HF tokenizer directory
    megatron-earl convert engine-model --config configs/demo_cpu.yaml --out DIR [key=value ...]

The run's model shape as the HF family it exports as (``family_for_model``), random weights (the
trainer pushes its own before the first rollout), the tokenizer's files, and in ``config.json``
the tokenizer's token ids (``token_ids_config``): SGLang stops a generation at the config's
``eos_token_id`` and, when the config has none, at its family's default (id 2 for Llama), which
for another tokenizer is an ordinary token that silently cuts generations short.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert.families import family_for_model
from megatron_earl.convert.tiny import write_random_hf


def token_ids_config(tokenizer: Any) -> dict[str, Any]:
    """``config.json``'s token ids of a ``ChatTokenizer``: ``eos_token_id`` lists every id that
    ends a generation (its stop ids: end of turn and end of sequence), ``pad_token_id``."""
    stops = list(dict.fromkeys(tokenizer.stop_ids))
    return {"eos_token_id": stops if len(stops) > 1 else stops[0], "pad_token_id": tokenizer.pad_id}


def write_engine_model(
    model: ModelConfig, tokenizer_name: str, out_dir: str | Path, seed: int = 0
) -> Path:
    """Write the directory (module docstring); returns it."""
    from megatron_earl.tokenizer import build_tokenizer

    out = write_random_hf(family_for_model(model).name, out_dir, model, seed)
    tokenizer = build_tokenizer(tokenizer_name)
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_name!r} has {tokenizer.vocab_size} ids, more than the model's "
            f"vocab_size {model.vocab_size}"
        )
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.update(token_ids_config(tokenizer))
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    _save_tokenizer(tokenizer_name, out)
    return out


def _save_tokenizer(tokenizer_name: str, out: Path) -> None:
    """The tokenizer's HF files into ``out`` (the demo tokenizer as its HF fast tokenizer)."""
    if tokenizer_name == "demo":
        from megatron_earl.tokenizer.demo_hf import demo_hf_tokenizer

        demo_hf_tokenizer().save_pretrained(out)
        return
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tokenizer_name).save_pretrained(out)
