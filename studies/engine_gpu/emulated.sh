#!/usr/bin/env bash
# The serving loop on an emulated H200 (--null-pass --device-cost, null_pass.emulate_device)
# on one CPU core: each rule with and without async scheduling (--ahead), alternated round
# by round, the burst of the H200 runs (2,000 requests at once):
#     bash studies/engine_gpu/emulated.sh [rounds]
#     python -m studies.engine_gpu.emulated_table studies/engine_gpu/emulated
# writes studies/engine_gpu/emulated/<policy>_<swap mode>_<sync|ahead>_<round>.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=studies/engine_gpu/emulated
mkdir -p "$out"
# The cost model the H200 run of engine_loop_ahead2_mlfq_proactive_on.json measured.
cost=0.0014086,2.4231e-06,1.04117e-05,0.00124645
for round in $(seq 1 "${1:-2}"); do
  for rule in fcfs:recompute mlfq:recompute mlfq:proactive; do
    for mode in sync ahead; do
      policy=${rule%%:*} swap=${rule##*:}
      flag=()
      [ "$mode" = ahead ] && flag=(--ahead)
      taskset -c 0 python -m studies.engine_gpu.engine_loop --null-pass --device-cost "$cost" \
        --device cpu --dtype float32 --layers 1 --hidden 64 --intermediate 128 --heads 2 \
        --kv-heads 1 --requests 2000 --policy "$policy" --swap-mode "$swap" "${flag[@]}" \
        --timeout 900 --out "$out/${policy}_${swap}_${mode}_${round}.json" > /dev/null
    done
  done
done
