#!/usr/bin/env bash
# The demo (configs/demo_cpu_switching.yaml, 30 GRPO steps after the SFT warm start) on 2 real
# SGLang engines behind SGLang's router (scripts/sglang_local.sh ENGINE=sglang), for every weight
# protocol and seed, beside the same seeds on the embedded engine; then the table of
# scripts/demo_runs_table.py (held-out success before -> after, the rollout/train log-prob gap,
# push seconds per step).
#
#   scripts/demo_on_sglang.sh                  # seeds 1 2 3; tensor distributed disk async relay
#   SEEDS="1" RUNS="tensor disk" scripts/demo_on_sglang.sh [key=value ...]
#
# RUNS: tensor (SGLang's own payload, engines on this host), distributed (gloo group), disk,
# async (tensor, rollout.mode=async, max_staleness=1), relay (one relay loading both engines),
# embedded (no SGLang: the same config on the embedded engine). OUT (default runs/sglang_demo)
# holds one run directory per run and its log; ENGINE_PORT as in sglang_local.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS:-1 2 3}
RUNS=${RUNS:-tensor distributed disk async relay embedded}
OUT=${OUT:-runs/sglang_demo}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CONFIG=configs/demo_cpu_switching.yaml
names=()
for seed in $SEEDS; do
    for run in $RUNS; do
        name="${run}_s${seed}"
        common=("seed=$seed" "output_dir=$OUT/runs" "name=$name" "$@")
        echo "demo_on_sglang.sh: $name" >&2
        case "$run" in
            embedded)
                megatron-earl train --nproc 2 --config "$CONFIG" "${common[@]}" > "$OUT/$name.log" 2>&1 ;;
            tensor|distributed|disk)
                ENGINE=sglang OUT="$OUT/$name" bash scripts/sglang_local.sh "$CONFIG" \
                    "rollout.sglang.weight_update=$run" "${common[@]}" > "$OUT/$name.log" 2>&1 ;;
            async)
                ENGINE=sglang OUT="$OUT/$name" bash scripts/sglang_local.sh "$CONFIG" \
                    rollout.mode=async rollout.max_staleness=1 "${common[@]}" > "$OUT/$name.log" 2>&1 ;;
            relay)
                ENGINE=sglang RELAYS=1 OUT="$OUT/$name" bash scripts/sglang_local.sh "$CONFIG" \
                    "${common[@]}" > "$OUT/$name.log" 2>&1 ;;
            *) echo "demo_on_sglang.sh: run '$run' is not one of tensor distributed disk async relay embedded" >&2
               exit 2 ;;
        esac
        names+=("$OUT/runs/$name")
    done
done
python scripts/demo_runs_table.py "${names[@]}"
