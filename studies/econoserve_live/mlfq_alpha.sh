#!/usr/bin/env bash
# Where skip-join MLFQ's decode time goes past capacity, and what promoting starved jobs sooner
# changes: runs' answers (`simulate --lengths-from`) on one cost table, under FCFS and under
# MLFQ with each starvation threshold α in ALPHAS ("default": `mlfq.starvation_s` unset, the
# normalized-latency budget of a max_model_len job).  Tables: natural_table's figures
# (mlfq_alpha_RATE.json) and tpot_by_length's decode breakdown (tpot_by_length_RATE.json).
# Usage: bash studies/econoserve_live/mlfq_alpha.sh RATE COST.json RUN.json...
#   (env ALPHAS, CAP, OUT, SCRATCH)
set -euo pipefail
cd "$(dirname "$0")/../.."
RATE=$1; COST=$2; shift 2
ALPHAS=${ALPHAS:-default 10 5 2}
CAP=${CAP:-256}
OUT=${OUT:-studies/econoserve_live/natural_replay}
SCRATCH=${SCRATCH:-/tmp/mlfq_alpha}
source studies/serve_lib.sh
mkdir -p "$OUT" "$SCRATCH"
sims=()
for run in "$@"; do
  label=$(run_name "$run" .json)
  for a in fcfs $ALPHAS; do
    case $a in
      fcfs) opts=(--policy fcfs); system=fcfs ;;
      default) opts=(--policy mlfq); system=mlfq ;;
      *) opts=(--policy mlfq --sched-opt "mlfq={\"starvation_s\": $a}"); system=mlfq-alpha$a ;;
    esac
    sim=$SCRATCH/$label.$system.json
    python -m bench simulate --workload-spec "$run" --lengths-from "$run" --lengths-cap "$CAP" \
      --cost-model "$COST" "${LIVE_SIM_ARGS[@]}" "${opts[@]}" --system "$system@$label" \
      --save-records --out "$sim" > /dev/null
    sims+=("$sim")
  done
done
python -m studies.econoserve_live.natural_table --cap "$CAP" --out "$OUT/mlfq_alpha_$RATE.json" \
  "${sims[@]}"
python -m studies.econoserve_live.tpot_by_length --out "$OUT/tpot_by_length_$RATE.json" "${sims[@]}"
