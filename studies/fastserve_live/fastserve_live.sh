#!/usr/bin/env bash
# Live FastServe comparison on this machine: FCFS vs skip-join MLFQ, same
# swap mode, ShareGPT (ignore_eos, total length <= MAX_TOTAL), Poisson at
# the rates given; no request is timed out before the run's end (MLFQ's
# longest waits pass 600 s under overload).  Policies are interleaved rate
# by rate (fcfs, mlfq at the first rate, then the second, …), each run on a
# freshly started server, so that the drift of a shared machine falls on
# both alike.  Writes
# studies/fastserve_live/{fcfs,mlfq}.json (+ runs/ and plots).
# Usage: bash studies/fastserve_live/fastserve_live.sh [N] [RATE...]   (env MAX_TOTAL: length cap,
# OUT: output folder)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=disabled
N=${1:-60}; shift || true
RATES=${*:-0.3 0.5 0.8}
MAX_TOTAL=${MAX_TOTAL:-320}
OUT=${OUT:-studies/fastserve_live}
mkdir -p "$OUT/runs"
source studies/serve_lib.sh
trap stop_server EXIT
for rate in $RATES; do
  for policy in fcfs mlfq; do
    start_server "studies/configs/$policy.yaml" "$OUT/$policy.server.log"
    python -m bench run --base-url http://127.0.0.1:8000/v1 --system "$policy" \
      --dataset sharegpt -n "$N" --max-total-len "$MAX_TOTAL" --seed 0 \
      --rate "$rate" --max-duration 1800 --request-timeout 1800 \
      --out "$OUT/runs/${policy}_$rate.json"
    # Every plan of the run, to set beside its simulation (python -m bench trace-summary).
    python -m bench trace-live --out "$OUT/runs/${policy}_$rate.trace.json.gz"
    stop_server
  done
done
for policy in fcfs mlfq; do
  python -m bench merge $(for r in $RATES; do echo "$OUT/runs/${policy}_$r.json"; done) \
    --out "$OUT/$policy.json"
done
python -m bench plot "$OUT/fcfs.json" "$OUT/mlfq.json" --out-dir "$OUT"
