#!/usr/bin/env bash
# The serving loop's host path alone (--null-pass) on one CPU core, under each rule, with the
# replica's collection thresholds and with Python's default, alternated round by round:
#     bash studies/engine_gpu/host_path.sh [rounds]
# writes studies/engine_gpu/host_path/<policy>_<swap mode>_young<N>_<round>.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=studies/engine_gpu/host_path
mkdir -p "$out"
for round in $(seq 1 "${1:-3}"); do
  for rule in fcfs:recompute mlfq:recompute mlfq:proactive; do
    for young in 3000 700; do
      policy=${rule%%:*} mode=${rule##*:}
      taskset -c 0 python -m studies.engine_gpu.engine_loop --null-pass --device cpu \
        --dtype float32 --layers 1 --hidden 64 --intermediate 128 --heads 2 --kv-heads 1 \
        --requests 1000 --policy "$policy" --swap-mode "$mode" --gc-young "$young" \
        --timeout 900 --out "$out/${policy}_${mode}_young${young}_${round}.json" > /dev/null
    done
  done
done
