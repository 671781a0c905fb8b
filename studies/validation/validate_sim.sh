#!/usr/bin/env bash
# Live-vs-simulated validation (FCFS): replay the workload of a live FCFS
# sweep in the simulator, with our engine's profiled cost table and the
# live server's scheduler settings (studies/configs/fcfs.yaml), and compare
# mean normalized latency rate by rate (target: within 20%).
#
#   python -m bench profile --out studies/validation/cost_table.json   # on a quiet machine
#   bash studies/fastserve_live/fastserve_live.sh 60 0.3 0.5 0.8                              # the live FCFS sweep
#   bash studies/validation/validate_sim.sh [LIVE_SWEEP_JSON] [RATE...]
set -euo pipefail
cd "$(dirname "$0")/../.."
LIVE=${1:-studies/fastserve_live/fcfs.json}; shift || true
RATES=${*:-0.3 0.5 0.8}
OUT=studies/validation
TABLE=${TABLE:-$OUT/cost_table.json}
source studies/serve_lib.sh
python -m bench simulate-sweep --workload-spec "$LIVE" --rates $RATES \
  --cost-model "$TABLE" --policy fcfs "${LIVE_SIM_ARGS[@]}" \
  --system fcfs-sim --out "$OUT/fcfs_sim.json"
python -m bench compare "$LIVE" "$OUT/fcfs_sim.json" --metric normalized_latency.mean --tolerance 0.2 \
  | tee "$OUT/compare.txt"
