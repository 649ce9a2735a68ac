#!/usr/bin/env bash
# Per-node torchrun under srun (one task per node): the node rank comes from slurm.
# Called by slurm_colocated.sbatch and slurm_disaggregated.sbatch, which export NNODES,
# NPROC_PER_NODE, MASTER_ADDR and MASTER_PORT; the arguments go to megatron_earl.cli.train.
set -euo pipefail
NODE_RANK=${SLURM_NODEID:-${SLURM_PROCID:?torchrun_node.sh must run under srun}}
# Network interface of the process groups across nodes: SOCKET_IFNAME (e.g. ib0, eth1) sets
# gloo's (the host groups every run has, GPU runs included) and NCCL's; a GLOO_SOCKET_IFNAME or
# NCCL_SOCKET_IFNAME already set wins. Unset: gloo takes the interface the host name resolves to
# and NCCL its own choice, which on nodes with several interfaces may be one the others cannot
# reach (the first collective then times out).
if [[ -n "${SOCKET_IFNAME:-}" ]]; then
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME}
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}
fi
exec "${TORCHRUN:-torchrun}" \
    --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --node-rank="$NODE_RANK" \
    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
    -m megatron_earl.cli.train "$@"
