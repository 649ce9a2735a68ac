"""Pre-flight check of a run config, for launch scripts: load, apply overrides, validate against
the world size (every check ``megatron-earl train`` makes: ``cli.train.check_run``), print one
line (or the one error) and exit, before any process is started.

    python -m megatron_earl.cli.check --world-size 16 --config configs/qwen2.5-7b_grpo.yaml \
        train.lr=1e-6 rollout.max_turns=8

Exit status 0 when the run can start, 2 with the error on stderr otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_earl.cli.train import check_run
from megatron_earl.config.loader import load_config
from megatron_earl.config.run import ConfigError
from megatron_earl.config.vocab import Phase
from megatron_earl.parallel.layout import phase_layout


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_earl.cli.check")
    parser.add_argument("--world-size", type=int, required=True, help="ranks the job will have")
    parser.add_argument("--config", default=None, help="YAML run config")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_run(cfg, args.world_size)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    layouts = " ".join(f"{p}={phase_layout(cfg.layouts, p)}" for p in Phase)
    print(f"config ok: {cfg.name} on {args.world_size} ranks: {layouts}; run dir {cfg.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
