"""Dispatch benchmark runner (megatron_earl/dispatch/bench.py): scripts/bench_dispatch.py -h"""

from megatron_earl.dispatch.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
