"""Benchmark: the converter's peak extra memory grows with one layer, not with the model.

    python -m megatron_earl.bench.convert_memory --layers 4 8 --hidden 512

For each layer count it writes a random HF model (``tiny.write_random_hf``), then runs
hf -> mcore and mcore -> hf, each in a fresh Python process that records its resident memory after
the imports (baseline) and its peak (``VmHWM``) after the conversion. Prints one line per run:
layers, model MB, layer MB, extra peak MB (peak - baseline). A streaming converter's extra peak is
a few layers' worth and the same for every model size; a converter that loads the model would add
the whole model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_earl.config.model import ModelConfig

_CHILD = r"""
import json, sys
def rss_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
direction, src, out = sys.argv[1:4]
from megatron_earl.convert import convert
if direction == "mcore-to-hf":
    from megatron_earl.convert.cli import _join_world_of_one
    _join_world_of_one()
    import megatron.core.dist_checkpointing.serialization  # noqa: F401
import safetensors.torch, torch.distributed.checkpoint  # noqa: F401
import megatron.core.dist_checkpointing.core  # noqa: F401  (imports are not conversion memory)
base = rss_mb("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
if direction == "hf-to-mcore":
    convert.hf_to_mcore(src, out, make_vocab_size_divisible_by=128)
else:
    convert.mcore_to_hf(src, out, max_shard_bytes=1)
print(json.dumps({"baseline_mb": base, "peak_mb": rss_mb("VmHWM:")}))
"""


def bench_model(num_layers: int, hidden: int) -> ModelConfig:
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=hidden * 3,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=1000,
    )


def layer_bytes(model: ModelConfig) -> int:
    return (
        (model.num_parameters() - model.padded_vocab_size * model.hidden_size * 2)
        * 4
        // max(1, model.num_layers)
    )


def run_child(direction: str, src: Path, out: Path) -> dict[str, float]:
    """Convert in a fresh process; its baseline and peak RSS (MB)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, direction, str(src), str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{direction} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(num_layers: int, hidden: int, root: Path) -> dict[str, float]:
    """Extra peak MB of both directions for a random Llama model of ``num_layers`` layers."""
    from megatron_earl.convert.tiny import write_random_hf

    model = bench_model(num_layers, hidden)
    hf = write_random_hf("llama", root / f"hf-{num_layers}", model)
    to_mcore = run_child("hf-to-mcore", hf, root / f"mcore-{num_layers}")
    to_hf = run_child("mcore-to-hf", root / f"mcore-{num_layers}", root / f"hf-back-{num_layers}")
    return {
        "layers": num_layers,
        "model_mb": model.num_parameters() * 4 / 2**20,
        "layer_mb": layer_bytes(model) / 2**20,
        "hf_to_mcore_extra_mb": to_mcore["peak_mb"] - to_mcore["baseline_mb"],
        "mcore_to_hf_extra_mb": to_hf["peak_mb"] - to_hf["baseline_mb"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            row = measure(layers, args.hidden, Path(tmp))
            print(
                f"layers={row['layers']:3d} model={row['model_mb']:7.1f}MB "
                f"layer={row['layer_mb']:6.1f}MB hidden={args.hidden} | extra peak: "
                f"hf->mcore {row['hf_to_mcore_extra_mb']:6.1f}MB, "
                f"mcore->hf {row['mcore_to_hf_extra_mb']:6.1f}MB",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
