"""Weight reshard benchmark (logic: megatron_earl/redistribute/bench.py). --help for options."""

from megatron_earl.redistribute.bench import main

if __name__ == "__main__":
    main()
