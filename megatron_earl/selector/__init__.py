"""Parallelism selector: per-phase layouts chosen from context length, memory and throughput.

memory.py (memory model) · throughput.py (tokens/s table + roofline) · decide.py (the decision) ·
oom.py (OOM recovery) · budget.py (CPU memory budget) · calibrate.py · profile.py (measured runs) ·
plan_cli.py (``megatron-earl plan``). The context-length sweep: ``megatron_earl.bench.selector``.
See docs/selector.md.
"""
