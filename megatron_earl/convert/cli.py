"""``megatron-earl convert``: HF <-> Megatron checkpoint conversion from the command line.

    megatron-earl convert hf-to-mcore --hf HF_DIR --out MCORE_DIR [--tp 2 --pp 2 --vpp 2]
        [--ep 2 --etp 1] [--make-vocab-size-divisible-by 128] [--dtype bfloat16]
    megatron-earl convert mcore-to-hf --ckpt MCORE_DIR --out HF_OUT [--hf-config HF_DIR]
        [--family qwen2] [--max-shard-size 5GB]
    megatron-earl convert engine-model --config CONFIG --out HF_DIR [key=value ...]

``main(argv)`` takes the arguments after ``convert``. Both directions run in one process (the
mcore -> HF direction joins a gloo world of one to use ``dist_checkpointing.load``). Errors
(``ConversionError``) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from megatron_earl.convert.families import ConversionError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (HF's convention), '512MiB', '1000' (bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"size {text!r}: use e.g. 5GB, 512MiB or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-earl convert")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron torch_dist")
    to_mcore.add_argument("--hf", required=True, help="HF model directory (config.json + weights)")
    to_mcore.add_argument("--out", required=True, help="output checkpoint directory (new)")
    to_mcore.add_argument("--tp", type=int, default=1, help="check the model splits at this TP")
    to_mcore.add_argument("--pp", type=int, default=1, help="check the model splits at this PP")
    to_mcore.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages")
    to_mcore.add_argument("--ep", type=int, default=1, help="check the experts split at this EP")
    to_mcore.add_argument("--etp", type=int, default=None, help="expert TP (default: --tp)")
    to_mcore.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    to_mcore.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast weights (default: keep the HF dtype)",
    )
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron torch_dist -> HF safetensors")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint dir (or a run dir with 'latest')")
    to_hf.add_argument("--out", required=True, help="output HF directory (new)")
    to_hf.add_argument("--hf-config", default=None, help="HF dir whose config/tokenizer to use")
    to_hf.add_argument(
        "--family", default=None, help="llama, qwen2, qwen3, qwen3_moe or mixtral (if not stored)"
    )
    to_hf.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"))
    engine = sub.add_parser(
        "engine-model",
        help="the HF directory an engine starts from for a run (convert.engine_model)",
    )
    engine.add_argument("--config", required=True, help="the run's YAML config")
    engine.add_argument("--out", required=True, help="output HF directory")
    engine.add_argument("overrides", nargs="*", help="key=value overrides, as for train")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_earl.convert import convert

    try:
        if args.direction == "engine-model":
            from megatron_earl.config.loader import load_config
            from megatron_earl.convert.engine_model import write_engine_model

            config = load_config(args.config, args.overrides)
            model = config.model
            write_engine_model(model, config.tokenizer, args.out, seed=config.seed)
        elif args.direction == "hf-to-mcore":
            model = convert.hf_to_mcore(
                args.hf,
                args.out,
                tp=args.tp,
                pp=args.pp,
                vpp=args.vpp,
                ep=args.ep,
                etp=args.etp,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                dtype=args.dtype,
            )
        else:
            _join_world_of_one()
            from megatron_earl.training.checkpoint import resolve_checkpoint

            model = convert.mcore_to_hf(
                resolve_checkpoint(args.ckpt),
                args.out,
                hf_config_dir=args.hf_config,
                family=args.family,
                max_shard_bytes=args.max_shard_size,
            )
    except (ConversionError, FileNotFoundError) as err:
        print(f"megatron-earl convert: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out)} ({model.num_layers} layers, {model.num_parameters():,} params)")
    return 0


def _join_world_of_one() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConversionError(
            f"mcore-to-hf runs in one process; WORLD_SIZE={os.environ['WORLD_SIZE']} (do not "
            "start it under torchrun/srun with several tasks)"
        )
    from megatron_earl import runtime

    runtime.initialize()


if __name__ == "__main__":
    sys.exit(main())
