"""Weight reshard benchmark (logic: megatron_earl/bench/reshard.py). --help for options."""

from megatron_earl.bench.reshard import main

if __name__ == "__main__":
    main()
