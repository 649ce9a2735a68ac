"""Embedded engine vs transformers generate, prefill and decode tokens/s (logic:
megatron_earl/bench/engine.py; same as `megatron-earl bench engine`). --help for options."""

import sys

from megatron_earl.bench.engine import main

if __name__ == "__main__":
    sys.exit(main())
