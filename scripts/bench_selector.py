"""Selector context-length sweep (logic: megatron_earl/selector/bench.py). --help for options."""

from megatron_earl.selector.bench import main

if __name__ == "__main__":
    main()
