"""Benchmarks, simulators, peer harnesses and the fault suite: beside the library, never in it.

Nothing under ``megatron_earl`` outside this package imports it; ``cli/main.py``'s command table
(``megatron-earl bench ...``) is its entry. Each module opens with what it measures and how to run
it: ``engine`` (+ ``engine_results``, ``engine_driver``, ``engine_hf``, ``engine_floor``: the
embedded engine against HF ``generate``), ``serve`` and ``soak`` (``serve`` under load), ``peer`` (+
``peer_trl``, ``peer_weights``, ``peer_workload``: one GRPO workload, ours against TRL), ``rl`` (the
RL step sweep), ``async_rl`` and ``async_sim`` (asynchronous RL, real and simulated),
``pipeline_sim``, ``repack``, ``relay``, ``host_syncs`` (device -> host syncs per step kind on the
emulation tier), ``dispatch`` (against ``dispatch.centralized``, the gather-to-rank-0 baseline),
``reshard``, ``selector``, ``convert_memory``, and ``fault_suite`` (faults injected into a real
asynchronous run).
"""
