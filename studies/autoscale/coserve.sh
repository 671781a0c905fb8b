#!/usr/bin/env bash
# Autoscaling while co-serving (studies/autoscale/README.md): a batch job (OFF
# lines of the conserve_live offline stream, through Ray Jobs) running from the
# start, and once its first offline tokens are out, a bursty ShareGPT stream
# (Gamma arrivals, CV 4) of N requests at RATE req/s; then TAIL seconds more
# of the batch job alone, in which offline work must not hold the second
# replica up.  One fixed engine replica against autoscaling from one to two,
# both under policy: conserve with online requests ordered by ORDER
# (conserve.online_order: mlfq or fcfs; the configs run are written to OUT).
#   bash studies/autoscale/coserve.sh   (env N, RATE, OFF, CONC, TAIL, ORDER, OUT)
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/serve_lib.sh
N=${N:-200}; RATE=${RATE:-1.4}; OFF=${OFF:-300}; CONC=${CONC:-64}; TAIL=${TAIL:-75}
ORDER=${ORDER:-mlfq}; OUT=${OUT:-studies/autoscale/runs_coserve_$ORDER}
mkdir -p "$OUT"
export RAY_AUTH_MODE=disabled
poller=
cleanup() { [ -n "$poller" ] && kill "$poller" 2>/dev/null; stop_server; }
trap cleanup EXIT
python -m studies.conserve_live.batch make-file "$OUT/batch.input.jsonl" "$OFF"
for system in fixed autoscaled; do
  cfg=$OUT/${system}_conserve.yaml
  sed -e 's/^\(      policy: conserve\)$/\1\n      conserve: {online_order: '"$ORDER"'}/' \
    "studies/autoscale/${system}_conserve.yaml" > "$cfg"
  grep -q "online_order: $ORDER" "$cfg"
  start_server "$cfg" "$OUT/$system.server.log"
  rm -f "$OUT/$system.replicas.jsonl"
  python -m studies.autoscale.replicas "$OUT/$system.replicas.jsonl" --tokens &
  poller=$!
  preempt-serve batch submit "$OUT/batch.input.jsonl" --config "$cfg" \
    --max-concurrency "$CONC" > "$OUT/$system.submit.log" 2>&1
  python -m studies.autoscale.coserve_report wait-offline "$OUT/$system.replicas.jsonl"
  python -m bench run --base-url http://127.0.0.1:8000/v1 --rate "$RATE" --cv 4 -n "$N" \
    --seed 3 --slo-ttft 2.0 --save-records --system "$system" --out "$OUT/$system.json" \
    > "$OUT/$system.log"
  sleep "$TAIL"
  kill "$poller"; poller=
  stop_server
done
python -m studies.autoscale.coserve_report report "$OUT" | tee "$OUT/report.txt"
