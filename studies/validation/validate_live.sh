#!/usr/bin/env bash
# Live-vs-simulated validation in one server session (FCFS, this machine):
#   1. start `serve run studies/configs/fcfs.yaml`;
#   2. a calibration run on another workload (seed 1) so that the engine
#      records iterations of the deployed replica;
#   3. `profile-live`: a cost table from those recorded iterations;
#   4. the live FCFS sweep to validate (seed 0);
#   5. stop the server, replay the sweep in the simulator with that table
#      (studies/validation/validate_sim.sh) and compare mean normalized latency.
# Usage: bash studies/validation/validate_live.sh [N] [RATE...]   (writes studies/validation/)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=disabled
N=${1:-60}; shift || true
RATES=${*:-0.2 0.3}
MAX_TOTAL=${MAX_TOTAL:-320}
OUT=studies/validation
URL=http://127.0.0.1:8000/v1
mkdir -p "$OUT"
source studies/serve_lib.sh
trap stop_server EXIT
start_server studies/configs/fcfs.yaml "$OUT/fcfs.server.log"
python -m bench run --base-url "$URL" --system fcfs --dataset sharegpt -n 40 \
  --max-total-len "$MAX_TOTAL" --seed 1 --rate 0.5 --max-duration 900 \
  --out "$OUT/calibration_run.json"
python -m bench profile-live --address auto --swaps-from "$OUT/cost_table.json" \
  --out "$OUT/cost_table_live.json"
python -m bench sweep --base-url "$URL" --system fcfs --dataset sharegpt -n "$N" \
  --max-total-len "$MAX_TOTAL" --seed 0 --rates $RATES --max-duration 900 \
  --out "$OUT/fcfs_live.json"
stop_server
trap - EXIT
TABLE="$OUT/cost_table_live.json" bash studies/validation/validate_sim.sh "$OUT/fcfs_live.json" $RATES
