"""Data dispatcher: layout-aware, decentralized redistribution of RL batches (docs/dispatch.md).

Pure: ``batch`` (packed variable-length batch), ``spec`` (the planner's inputs), ``plan`` (CP
chunks, micro-batches, needs per rank), ``rank_view`` (one rank's view of a plan), ``table``
(the sample table), ``balance`` (DP assignment), ``route`` (sources, TP fan-out, transfer stages),
``centralized`` (the single-controller baseline's stages), ``netmodel`` (cluster projection),
``reference`` (test data and naive reference). Communicating: ``execute`` (forward), ``reverse``
(results back). Its benchmark: ``megatron_earl.bench.dispatch``.
"""

from megatron_earl.dispatch.batch import Batch, BatchError, FieldSpec, Schema
from megatron_earl.dispatch.plan import (
    DispatchPlan,
    cp_chunk_bounds,
    cp_padded_length,
    plan_dispatch,
    plan_return,
)
from megatron_earl.dispatch.route import DispatchError, RouteConfig
from megatron_earl.dispatch.spec import Destination, PlanConfig, SourceMeta

__all__ = [
    "Batch",
    "BatchError",
    "Destination",
    "DispatchError",
    "DispatchPlan",
    "FieldSpec",
    "PlanConfig",
    "RouteConfig",
    "Schema",
    "SourceMeta",
    "cp_chunk_bounds",
    "cp_padded_length",
    "plan_dispatch",
    "plan_return",
]
