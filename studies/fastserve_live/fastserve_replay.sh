#!/usr/bin/env bash
# Replay every run of studies/fastserve_live/fastserve_live.sh in the simulator, with the
# cost table measured in place and the live server's settings, and lay each
# beside its live run: mean normalized latency (python -m bench compare)
# and the plan traces (python -m bench trace-summary).
# Usage: bash studies/fastserve_live/fastserve_replay.sh [RATE...]   (after studies/fastserve_live/fastserve_live.sh;
# env RUNS: its runs/ folder, TABLE: the cost table)
set -euo pipefail
cd "$(dirname "$0")/../.."
RATES=${*:-0.3 0.5 0.8}
RUNS=${RUNS:-studies/fastserve_live/runs}
TABLE=${TABLE:-studies/validation/cost_table_live.json}
source studies/serve_lib.sh
for policy in fcfs mlfq; do
  for rate in $RATES; do
    run=$RUNS/${policy}_$rate
    python -m bench simulate --workload-spec "$run.json" --cost-model "$TABLE" --policy "$policy" \
      "${LIVE_SIM_ARGS[@]}" --system "$policy-sim" --out "$run.sim.json" \
      --trace-out "$run.sim.trace.json.gz" > /dev/null
    echo "== $policy at $rate req/s: live vs simulated"
    python -m bench compare "$run.json" "$run.sim.json" || true
    python -m bench trace-summary "$run.trace.json.gz" "$run.sim.trace.json.gz"
  done
done
