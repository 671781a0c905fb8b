#!/usr/bin/env bash
# One fixed engine replica, coserve.sh's bursty stream (200 ShareGPT requests,
# Gamma CV 4, 1.4 req/s, seed 3) and no batch job: MLFQ alone against
# policy: conserve with online requests in MLFQ order, recompute and proactive
# swapping.  Reads the configs $OUT/{system}.yaml (overload_1128/ has them);
# writes {system}.json, .engine.json, .log; then the figures (overload.py).
#   OUT=studies/autoscale/overload_1128 bash studies/autoscale/overload.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/serve_lib.sh
export RAY_AUTH_MODE=disabled
OUT=${OUT:-studies/autoscale/overload_1128}
trap stop_server EXIT
for system in ${SYSTEMS:-mlfq conserve_recompute conserve_proactive}; do
  start_server "$OUT/$system.yaml" "$OUT/$system.server.log"
  python -m bench run --base-url http://127.0.0.1:8000/v1 --rate 1.4 --cv 4 -n 200 \
    --seed 3 --slo-ttft 2.0 --save-records --system "$system" --out "$OUT/$system.json" \
    > "$OUT/$system.log"
  dump_engine_stats "$OUT/$system.engine.json"
  stop_server
done
python -m studies.autoscale.overload "$OUT"
