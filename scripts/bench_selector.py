"""Selector context-length sweep (logic: megatron_earl/bench/selector.py). --help for options."""

from megatron_earl.bench.selector import main

if __name__ == "__main__":
    main()
