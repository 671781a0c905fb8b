#!/usr/bin/env bash
# head.sh's runs (answers that ended by themselves) replayed in the simulator, two ways:
# 1. each run that kept its cost table, with that table (its iterations' costs) and its own
#    policy, set beside it: does the simulator reproduce a run whose answers end by themselves?
#    (natural_own_RATE.json: each live run's row, then its replay's; replay_RATE.txt: bench
#    compare and bench trace-summary of the two)
# 2. on one cost table for all (COST), every run's answers (prompts, arrivals and answer lengths
#    as served: `simulate --lengths-from`) under each of POLICIES (default FCFS, MLFQ and
#    EconoServe; EconoServe with the predictions PRED_RUN recorded, which depend on the prompt
#    alone): the policies compared with the host's speed and the answers' sampling held fixed
#    (natural_replay_RATE_on_TABLE[SUFFIX].json, TABLE naming COST as ROUND.NAME).
# POLICIES name this folder's configurations: fcfs, mlfq, econoserve (paused GTs drop their KV),
# econoserve-swap (they swap it to the host tier), econoserve-keep (they keep it on the device),
# econoserve-head (drop; the estimates each replayed run recorded, landing with the first token:
# for econoserve-head runs, whose estimates are the engine head's).
# A run is named ROUND.NAME by the folder holding its runs/ and its file.  The simulated runs
# themselves go to SCRATCH (deterministic: this script makes them again); the tables are kept.
# Usage: bash studies/econoserve_live/natural_replay.sh RATE COST.json PRED_RUN.json RUN.json...
#   (env CAP: the runs' max_tokens; OUT; SCRATCH; POLICIES; SUFFIX)
set -euo pipefail
cd "$(dirname "$0")/../.."
RATE=$1; COST=$2; PRED=$3; shift 3
CAP=${CAP:-256}
OUT=${OUT:-studies/econoserve_live/natural_replay}
SCRATCH=${SCRATCH:-/tmp/natural_replay}
POLICIES=${POLICIES:-fcfs mlfq econoserve}
SUFFIX=${SUFFIX:-}
source studies/serve_lib.sh
mkdir -p "$OUT" "$SCRATCH"
# The simulator's options (opts) for a configuration of this folder; EconoServe takes the
# predictions of the run given second, econoserve-head the estimates of the run given third.
policy_opts() {
  case $1 in
    fcfs|mlfq) opts=(--policy "$1") ;;
    econoserve-head)
      opts=(--policy econoserve --sched-opt 'econoserve={"pause_kv": "drop"}'
            --predictions-from "$3" --prediction-at-first-token) ;;
    econoserve|econoserve-swap|econoserve-keep)
      local pause=drop
      [ "$1" = econoserve-swap ] && pause=swap
      [ "$1" = econoserve-keep ] && pause=keep
      opts=(--policy econoserve --sched-opt "econoserve={\"pause_kv\": \"$pause\"}"
            --predictions-from "$2") ;;
    *) return 1 ;;
  esac
}
TAG=$(run_name "$COST" .cost.json)
: > "$OUT/replay_$RATE$SUFFIX.txt"
sims=(); own=()
for run in "$@"; do
  label=$(run_name "$run" .json)
  for p in $POLICIES; do
    policy_opts "$p" "$PRED" "$run"
    sim=$SCRATCH/$label.$p.on.$TAG.json
    python -m bench simulate --workload-spec "$run" --lengths-from "$run" --lengths-cap "$CAP" \
      --cost-model "$COST" "${LIVE_SIM_ARGS[@]}" "${opts[@]}" \
      --system "$p@$label" --save-records --out "$sim" > /dev/null
    sims+=("$sim")
  done
  policy=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['meta']['system'])" "$run")
  if [ -f "${run%.json}.cost.json" ] && policy_opts "$policy" "$run" "$run"; then
    sim=$SCRATCH/$label.own.json
    python -m bench simulate --workload-spec "$run" --lengths-from "$run" --lengths-cap "$CAP" \
      --cost-model "${run%.json}.cost.json" "${LIVE_SIM_ARGS[@]}" "${opts[@]}" \
      --system "$policy-sim@$label" --save-records --out "$sim" \
      --trace-out "${sim%.json}.trace.json.gz" > /dev/null
    echo "== $label: live vs simulated on its own cost table" >> "$OUT/replay_$RATE$SUFFIX.txt"
    python -m bench compare "$run" "$sim" >> "$OUT/replay_$RATE$SUFFIX.txt" || true
    python -m bench trace-summary "${run%.json}.trace.json.gz" "${sim%.json}.trace.json.gz" \
      >> "$OUT/replay_$RATE$SUFFIX.txt"
    own+=("$run" "$sim")
  fi
done
if [ ${#own[@]} -gt 0 ]; then
  python -m studies.econoserve_live.natural_table --cap "$CAP" \
    --out "$OUT/natural_own_$RATE$SUFFIX.json" "${own[@]}"
fi
python -m studies.econoserve_live.natural_table --cap "$CAP" \
  --out "$OUT/natural_replay_${RATE}_on_$TAG$SUFFIX.json" "${sims[@]}"
