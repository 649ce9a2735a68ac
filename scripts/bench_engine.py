"""Embedded-engine decode benchmark (logic: megatron_earl/rollout/bench.py). --help for options."""

from megatron_earl.rollout.bench import main

if __name__ == "__main__":
    main()
