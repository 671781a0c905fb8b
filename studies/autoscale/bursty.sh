#!/usr/bin/env bash
# A bursty ShareGPT stream (Gamma arrivals, CV 4) against one fixed engine
# replica and against autoscaling from one to two (studies/autoscale/README.md).
#   bash studies/autoscale/bursty.sh [N] [RATE]
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/serve_lib.sh
N=${N:-${1:-200}}
RATE=${RATE:-${2:-0.5}}
OUT=${OUT:-studies/autoscale/runs}
mkdir -p "$OUT"
export RAY_AUTH_MODE=disabled
trap stop_server EXIT
for system in fixed autoscaled; do
  start_server "studies/autoscale/$system.yaml" "$OUT/$system.server.log"
  rm -f "$OUT/$system.replicas.jsonl"
  python -m studies.autoscale.replicas "$OUT/$system.replicas.jsonl" &
  poller=$!
  python -m bench run --base-url http://127.0.0.1:8000/v1 --rate "$RATE" --cv 4 -n "$N" \
    --seed 3 --slo-ttft 2.0 --save-records --system "$system" --out "$OUT/$system.json" \
    > "$OUT/$system.log"
  kill "$poller" || true
  stop_server
done
python -m studies.autoscale.report "$OUT" | tee "$OUT/report.txt"
