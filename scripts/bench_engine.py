"""Embedded engine vs transformers generate, prefill and decode tokens/s (logic:
megatron_earl/rollout/bench.py; same as `megatron-earl bench engine`). --help for options."""

import sys

from megatron_earl.rollout.bench import main

if __name__ == "__main__":
    sys.exit(main())
