"""Dispatch benchmark runner (megatron_earl/bench/dispatch.py): scripts/bench_dispatch.py -h"""

from megatron_earl.bench.dispatch import main

if __name__ == "__main__":
    raise SystemExit(main())
