#!/usr/bin/env bash
# Live EconoServe comparison on this machine: FCFS, skip-join MLFQ and EconoServe, the same
# server settings and a predictor beside the engine for all three
# (studies/econoserve_live/*.yaml), ShareGPT (ignore_eos, total length <= MAX_TOTAL),
# Poisson at the rates given.  Policies are interleaved rate by rate, each run on a freshly
# started server.  Each run is then replayed in the simulator with the cost table of its own
# iterations (bench profile-live; swap costs from TABLE) and, for econoserve, the predictions
# the live run recorded, and set beside it (replay.txt).
# POLICIES (default "fcfs mlfq econoserve") may also name mlfq-predicted: skip-join MLFQ with
# its prediction switches on (mlfq-predicted.yaml), replayed with the recorded predictions.
# SEED (default 0) draws the requests and their arrivals.
# Usage: bash studies/econoserve_live/run.sh [N] [RATE...]   (env MAX_TOTAL, OUT, POLICIES, SEED)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=disabled
N=${1:-50}; shift || true
RATES=${*:-0.35 0.5 0.7}
MAX_TOTAL=${MAX_TOTAL:-320}
OUT=${OUT:-studies/econoserve_live}
TABLE=${TABLE:-studies/validation/cost_table_live.json}
POLICIES=${POLICIES:-fcfs mlfq econoserve}
mkdir -p "$OUT/runs"
source studies/serve_lib.sh
trap stop_server EXIT
for rate in $RATES; do
  for policy in $POLICIES; do
    run=$OUT/runs/${policy}_$rate
    start_server "studies/econoserve_live/$policy.yaml" "$OUT/runs/$policy.server.log"
    python -m bench run --base-url http://127.0.0.1:8000/v1 --system "$policy" \
      --dataset sharegpt -n "$N" --max-total-len "$MAX_TOTAL" --seed "${SEED:-0}" \
      --rate "$rate" --max-duration 1800 --request-timeout 1800 --save-records \
      --out "$run.json"
    python -m bench trace-live --out "$run.trace.json.gz"
    python -m bench profile-live --swaps-from "$TABLE" --out "$run.cost.json" > /dev/null
    stop_server
    preds=()
    sim_policy=$policy
    case $policy in
      # Paused GTs drop their KV, as econoserve.yaml pins (the default swaps them).
      econoserve) preds=(--predictions-from "$run.json"
                         --sched-opt 'econoserve={"pause_kv": "drop"}') ;;
      mlfq-predicted) sim_policy=mlfq
        preds=(--predictions-from "$run.json"
               --sched-opt 'mlfq={"skip_join": "predicted", "enst": "predicted"}') ;;
    esac
    python -m bench simulate --workload-spec "$run.json" --cost-model "$run.cost.json" \
      --policy "$sim_policy" "${LIVE_SIM_ARGS[@]}" "${preds[@]}" --system "$policy-sim" \
      --out "$run.sim.json" --trace-out "$run.sim.trace.json.gz" > /dev/null
    echo "== $policy at $rate req/s: live vs simulated" | tee -a "$OUT/replay.txt"
    python -m bench compare "$run.json" "$run.sim.json" | tee -a "$OUT/replay.txt" || true
    python -m bench trace-summary "$run.trace.json.gz" "$run.sim.trace.json.gz" \
      | tee -a "$OUT/replay.txt"
  done
done
