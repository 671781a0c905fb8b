#!/usr/bin/env bash
# Co-serving live on this machine (embedded SmolLM2, one engine core): an
# online ShareGPT stream at RATE req/s beside a backlog of OFF offline
# requests (job_class offline, all sent at t = 0), prompt + answer <= CAP
# tokens, ignore_eos.  Six runs, each on a freshly started server:
#   online-only   the online stream alone, FCFS
#   offline-only  the backlog alone, FCFS
#   vllm++        both, FCFS with the offline requests at priority 1
#   conserve      both, policy: conserve (default objectives)
#   conserve-startup  the same, the budget on the start-up cost fit alone
#                 (conserve.cost_fit: startup)
#   conserve-tpot300  both, policy: conserve with objectives for a slower
#                 CPU (TTFT 1 s, TPOT 0.3 s)
#   conserve-tpotT  for each T in TPOTS (seconds, e.g. "0.05 0.06"): conserve
#                 with the TPOT objective set to T (its config written to $OUT)
# then the comparison (summary.py).  Writes $OUT/{name}.json, the engine
# replica's stats after the run ($OUT/{name}.engine.json: the live cost fit's
# coefficients among them) and summary.{json,md}.
# Usage: bash studies/conserve_live/run.sh   (env N, RATE, OFF, CAP, OUT; SYSTEMS:
# the runs to make, default (unset) all six; TPOTS: the objectives to sweep, default none)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=disabled
N=${N:-60}; RATE=${RATE:-0.35}; OFF=${OFF:-40}; CAP=${CAP:-320}
OUT=${OUT:-studies/conserve_live}
source studies/serve_lib.sh
trap stop_server EXIT
common=(--base-url http://127.0.0.1:8000/v1 --dataset sharegpt --max-total-len "$CAP" --seed 0
        --rate "$RATE" --max-duration 1800 --request-timeout 1800)
SYSTEMS=${SYSTEMS-online-only offline-only vllm++ conserve conserve-startup conserve-tpot300}
run() {
  local name=$1 cfg=$2; shift 2
  case " $SYSTEMS " in *" $name "*) ;; *) return 0 ;; esac
  case $cfg in *.yaml) ;; *) cfg=studies/configs/$cfg.yaml ;; esac
  start_server "$cfg" "$OUT/$name.server.log"
  python -m bench run "${common[@]}" --system "$name" "$@" --save-records --out "$OUT/$name.json"
  python -c "import json, sys; from bench.server_stats import RayStatsSource
json.dump(RayStatsSource().engines(), open(sys.argv[1], 'w'), indent=1, default=str)" \
    "$OUT/$name.engine.json" || true
  stop_server
}
run online-only coserve_fcfs -n "$N"
run offline-only coserve_fcfs -n 0 --offline-num-requests "$OFF"
run vllm++ coserve_fcfs -n "$N" --offline-num-requests "$OFF" --offline-priority 1
run conserve coserve_conserve -n "$N" --offline-num-requests "$OFF"
run conserve-startup coserve_conserve_startup -n "$N" --offline-num-requests "$OFF"
run conserve-tpot300 coserve_conserve_tpot300 -n "$N" --offline-num-requests "$OFF"
for t in ${TPOTS:-}; do
  name=conserve-tpot$t
  SYSTEMS="$SYSTEMS $name"
  sed -e '1,2c # Written by studies/conserve_live/run.sh: coserve_conserve.yaml, TPOT objective '"$t"' s.' \
      -e 's/^\(      admission:\)$/      conserve:\n        tpot_slo_s: '"$t"'\n\1/' \
      studies/configs/coserve_conserve.yaml > "$OUT/$name.yaml"
  grep -q "tpot_slo_s: $t" "$OUT/$name.yaml"
  run "$name" "$OUT/$name.yaml" -n "$N" --offline-num-requests "$OFF"
done
python -m studies.conserve_live.summary "$OUT"
