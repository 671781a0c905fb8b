#!/usr/bin/env bash
# Kill one of two engine replicas in the middle of a ShareGPT run near 70 %
# of the pair's capacity (LOAD); what became of the requests (studies/survival/README.md).
#   bash studies/survival/replica_kill.sh [N] [KILL_AT_S]
# CONFIG=studies/survival/two_replicas_checkpoints.yaml: with survival checkpoints.
# RATE=R: offer R req/s instead of 70 % of a capacity probe (a pair of runs at one rate);
# LOAD=F: offer F times the probed capacity instead of 0.7.
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/serve_lib.sh
N=${N:-${1:-300}}
KILL_AT=${KILL_AT:-${2:-120}}
LOAD=${LOAD:-0.7}
OUT=${OUT:-studies/survival/runs}
CONFIG=${CONFIG:-studies/survival/two_replicas.yaml}
mkdir -p "$OUT"
export RAY_AUTH_MODE=disabled
trap stop_server EXIT
start_server "$CONFIG" "$OUT/server.log"
if [ -z "${RATE:-}" ]; then
  # Capacity of the pair: 64 requests at once.
  python -m bench run --base-url http://127.0.0.1:8000/v1 --rate inf -n 64 --seed 7 \
    --out "$OUT/probe.json" > "$OUT/probe.log"
  RATE=$(python -c "import json; r = json.load(open('$OUT/probe.json')); \
print(round($LOAD * r['summary']['request_throughput'], 3))")
  echo "probe: $LOAD of capacity = $RATE req/s"
fi
# Every replica's exposure (tokens past its jobs' checkpoints) through the run.
python -m studies.survival.watch "$OUT/exposure.jsonl" 2 > "$OUT/watch.log" 2>&1 &
watch=$!
trap 'kill $watch 2>/dev/null || true; stop_server' EXIT
python -m bench run --base-url http://127.0.0.1:8000/v1 --rate "$RATE" -n "$N" --seed 1 \
  --save-records --out "$OUT/run.json" > "$OUT/run.log" &
run=$!
sleep "$KILL_AT"
python -m studies.survival.kill > "$OUT/kill.json"
wait "$run"
kill "$watch" 2>/dev/null || true
python -m studies.survival.kill --stats > "$OUT/after.json"
python -m studies.survival.report "$OUT" | tee "$OUT/report.txt"
