#!/usr/bin/env bash
# The disaggregated setup on one machine: N `megatron-earl serve` engines (SGLang's native HTTP
# API, the embedded engine behind it) behind SGLang's router, and the trainer driving them with
# rollout.engine=sglang -- what scripts/slurm_disaggregated.sbatch does across nodes with real
# SGLang servers. Runs on CPU; every piece is a real process talking HTTP (and gloo for the
# distributed weight update).
#
#   scripts/sglang_local.sh [CONFIG] [key=value ...]
#   scripts/sglang_local.sh configs/demo_cpu_switching.yaml rollout.sglang.weight_update=distributed
#
# Environment: ENGINES (default 2), ROUTER (1: SGLang's router in front, default; 0: the
# trainer's own engine pool), ROUTER_POLICY (default cache_aware), ENGINE_PORT (first port,
# default 31000), ENGINE_BATCH (max batch per engine, default 64), SGLANG_API_KEY (default: one
# generated for this run), OUT (logs and the shared weight directory, default
# runs/sglang_local), PACE_DECODE_MS (measurement only: every engine's decode step lasts at
# least this many ms, `serve --pace-decode-ms`; default 0, unpaced), NPROC, PYTHON,
# OMP_NUM_THREADS (as scripts/train_local.sh), RELAYS (0: the trainer pushes to every engine,
# default; N > 0: the relay weight service, docs/relay.md -- a root relay the trainer publishes
# to and N relays pulling from it, relay j feeding engines j, j + N, ...; ports after the
# router's), REPACK (none: default; drain or repack: rollout.repack, docs/relay.md -- needs
# RELAYS > 0, turns the router off since the trainer routes each trajectory itself, and starts
# the relays with --release-holders NPROC).
# ENGINE (serve: `megatron-earl serve`, default; sglang: the real SGLang server, CPU build, from the
# venv of scripts/install_sglang_cpu.sh, which SGLANG_PYTHON overrides; its model directory is
# `megatron-earl convert engine-model` of the same config, and the tensor protocol then defaults
# to SGLang's own payload, tensor_payload=sglang: SGLang cannot read the portable one).
# The engines start with random weights: the trainer pushes its own before the first rollout.
set -euo pipefail

CONFIG=${1:-configs/demo_cpu_switching.yaml}
[[ $# -gt 0 ]] && shift
PYTHON=${PYTHON:-python}
ENGINES=${ENGINES:-2}
ROUTER=${ROUTER:-1}
ROUTER_POLICY=${ROUTER_POLICY:-cache_aware}
RELAYS=${RELAYS:-0}
REPACK=${REPACK:-none}
ENGINE_PORT=${ENGINE_PORT:-31000}
ENGINE_BATCH=${ENGINE_BATCH:-64}
ENGINE=${ENGINE:-serve}
PACE_DECODE_MS=${PACE_DECODE_MS:-0}
OUT=${OUT:-runs/sglang_local}
case "$REPACK" in
    none) HOLDERS=0 ;;
    drain|repack)
        if (( RELAYS < 1 )); then
            echo "sglang_local.sh: REPACK=$REPACK needs RELAYS >= 1 (engines loaded by relays)" >&2
            exit 2
        fi
        ROUTER=0
        HOLDERS=${NPROC:-2} ;;
    *) echo "sglang_local.sh: REPACK '$REPACK' is not one of none, drain, repack" >&2; exit 2 ;;
esac
case "$ENGINE" in
    serve|sglang) ;;
    *) echo "sglang_local.sh: ENGINE '$ENGINE' is not one of serve, sglang" >&2; exit 2 ;;
esac
if [[ ! -f "$CONFIG" ]]; then
    echo "sglang_local.sh: config file '$CONFIG' does not exist" >&2
    exit 2
fi
mkdir -p "$OUT/engines" "$OUT/weights"
OUT=$(cd "$OUT" && pwd)
if [[ -z "${SGLANG_API_KEY:-}" ]]; then
    SGLANG_API_KEY=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(24))')
fi
export SGLANG_API_KEY

# The engines' model and context limit, from the same config and overrides as the trainer.
read -r MAX_CONTEXT DTYPE < <("$PYTHON" - "$CONFIG" "$OUT/engines/model.json" "$@" <<'PY'
import json, sys
from megatron_earl.config.loader import load_config
config = load_config(sys.argv[1], sys.argv[3:])
with open(sys.argv[2], "w") as f:
    json.dump(config.model.to_dict(), f)
print(config.rollout.max_context, config.model.params_dtype)
PY
)
if [[ "$ENGINE" == sglang ]]; then
    SGLANG_PYTHON=${SGLANG_PYTHON:-$(bash "$(dirname "$0")/install_sglang_cpu.sh")}
    rm -rf "$OUT/engines/model"
    "$PYTHON" -m megatron_earl.cli.main convert engine-model --config "$CONFIG" \
        --out "$OUT/engines/model" "$@" > /dev/null
fi

PIDS=()
cleanup() {
    if (( ${#PIDS[@]} )); then
        kill "${PIDS[@]}" 2>/dev/null || true
        wait "${PIDS[@]}" 2>/dev/null || true
    fi
}
trap cleanup EXIT

wait_up() {  # url what [pid]: fails at once when the process has exited (e.g. port taken)
    for (( waited = 0; waited < 600; waited++ )); do
        if curl -sf -o /dev/null "$1/health"; then
            return 0
        fi
        if [[ -n "${3:-}" ]] && ! kill -0 "$3" 2>/dev/null; then
            echo "sglang_local.sh: $2 $1 exited before it was healthy (log in $OUT/engines)" >&2
            exit 1
        fi
        sleep 0.5
    done
    echo "sglang_local.sh: $2 $1 not healthy after 300s (log in $OUT/engines)" >&2
    exit 1
}

URLS=()
for (( i = 0; i < ENGINES; i++ )); do
    port=$(( ENGINE_PORT + i ))
    if [[ "$ENGINE" == sglang ]]; then
        # SGLang's CPU path (rollout/sglang/launcher.py: SGLANG_CPU_ENV, sglang_cpu_args)
        SGLANG_USE_CPU_ENGINE=1 SGLANG_RETURN_ORIGINAL_LOGPROB=1 OMP_NUM_THREADS=1 \
            "$SGLANG_PYTHON" -m sglang.launch_server --model-path "$OUT/engines/model" \
            --host 127.0.0.1 --port "$port" --api-key "$SGLANG_API_KEY" --skip-server-warmup \
            --device cpu --attention-backend torch_native --disable-cuda-graph --dtype "$DTYPE" \
            --max-total-tokens $(( ENGINE_BATCH * MAX_CONTEXT )) \
            --max-running-requests "$ENGINE_BATCH" \
            > "$OUT/engines/engine$i.log" 2>&1 &
    else
        OMP_NUM_THREADS=1 "$PYTHON" -m megatron_earl.rollout.serve.server --model-path random \
            --model-config "$OUT/engines/model.json" --host 127.0.0.1 --port "$port" \
            --max-seq-len "$MAX_CONTEXT" --max-batch-size "$ENGINE_BATCH" \
            --api-key "$SGLANG_API_KEY" --weight-dirs "$OUT/weights" \
            --pace-decode-ms "$PACE_DECODE_MS" \
            > "$OUT/engines/engine$i.log" 2>&1 &
    fi
    PIDS+=($!)
    URLS+=("http://127.0.0.1:${port}")
done
for url in "${URLS[@]}"; do
    wait_up "$url" engine
done
URL_LIST=$(IFS=,; echo "${URLS[*]}")
DEFAULTS=()
if [[ "$ENGINE" == sglang ]]; then
    DEFAULTS+=("rollout.sglang.tensor_payload=sglang")  # what SGLang reads (engines on this host)
fi
OVERRIDES=("${DEFAULTS[@]}" "$@" "rollout.engine=sglang" "rollout.engine_urls=[${URL_LIST}]"
           "rollout.sglang.weight_dir=$OUT/weights")

if [[ "$ROUTER" == 1 ]]; then
    ROUTER_URL="http://127.0.0.1:$(( ENGINE_PORT + ENGINES ))"
    METRICS_PORT=$(( ENGINE_PORT + ENGINES + 1 ))
    "$PYTHON" -m sglang_router.launch_router --worker-urls "${URLS[@]}" --host 127.0.0.1 \
        --port "${ROUTER_URL##*:}" --policy "$ROUTER_POLICY" --api-key "$SGLANG_API_KEY" \
        --prometheus-host 127.0.0.1 --prometheus-port "$METRICS_PORT" --log-level warn \
        > "$OUT/engines/router.log" 2>&1 &
    PIDS+=($!)
    wait_up "$ROUTER_URL" router
    OVERRIDES+=("rollout.sglang.router_url=${ROUTER_URL}")
fi

if (( RELAYS > 0 )); then
    RELAY_PORT=$(( ENGINE_PORT + ENGINES + 2 ))
    ROOT_URL="http://127.0.0.1:${RELAY_PORT}"
    "$PYTHON" -m megatron_earl.rollout.weights.relay.server --port "$RELAY_PORT" > "$OUT/engines/relay_root.log" 2>&1 &
    PIDS+=($!)
    wait_up "$ROOT_URL" relay $!
    for (( j = 0; j < RELAYS; j++ )); do
        FED=()
        for (( i = j; i < ENGINES; i += RELAYS )); do FED+=("${URLS[$i]}"); done
        port=$(( RELAY_PORT + 1 + j ))
        "$PYTHON" -m megatron_earl.rollout.weights.relay.server --port "$port" --upstream "$ROOT_URL" \
            --engines "$(IFS=,; echo "${FED[*]}")" --release-holders "$HOLDERS" \
            > "$OUT/engines/relay$j.log" 2>&1 &
        PIDS+=($!)
        wait_up "http://127.0.0.1:${port}" relay $!
    done
    OVERRIDES+=("rollout.sglang.weight_update=relay" "rollout.sglang.relay_urls=[${ROOT_URL}]")
    if [[ "$REPACK" != none ]]; then
        FEEDS=()  # the relay of each engine, in engine order
        for (( i = 0; i < ENGINES; i++ )); do
            FEEDS+=("http://127.0.0.1:$(( RELAY_PORT + 1 + i % RELAYS ))")
        done
        OVERRIDES+=("rollout.repack.policy=$REPACK"
                    "rollout.sglang.engine_relays=[$(IFS=,; echo "${FEEDS[*]}")]")
        echo "sglang_local.sh: rollout.repack.policy=$REPACK (no router; relays load on release)"
    fi
    echo "sglang_local.sh: root relay ${ROOT_URL}, ${RELAYS} relays feeding the engines"
fi

if [[ "$PACE_DECODE_MS" != 0 ]]; then
    echo "sglang_local.sh: engines PACED: every decode step >= ${PACE_DECODE_MS} ms"
fi
echo "sglang_local.sh: ${ENGINES} engines ${URL_LIST}${ROUTER_URL:+ behind the router $ROUTER_URL}"
bash "$(dirname "$0")/train_local.sh" "$CONFIG" "${OVERRIDES[@]}"
