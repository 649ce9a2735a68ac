"""Peer benchmark, ours vs TRL's GRPOTrainer (logic: megatron_earl/bench/peer.py).
--help for options; needs `pip install -e '.[bench]'`."""

import sys

from megatron_earl.bench.peer import main

if __name__ == "__main__":
    sys.exit(main())
