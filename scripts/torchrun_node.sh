#!/usr/bin/env bash
# Per-node torchrun under srun (one task per node): the node rank comes from slurm.
# Called by slurm_colocated.sbatch and slurm_disaggregated.sbatch, which export NNODES,
# NPROC_PER_NODE, MASTER_ADDR and MASTER_PORT; the arguments go to megatron_earl.cli.train.
set -euo pipefail
NODE_RANK=${SLURM_NODEID:-${SLURM_PROCID:?torchrun_node.sh must run under srun}}
exec "${TORCHRUN:-torchrun}" \
    --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --node-rank="$NODE_RANK" \
    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
    -m megatron_earl.cli.train "$@"
