#!/usr/bin/env bash
# Co-serving live with the batch work as a batch file through Ray Jobs: the
# conserve configuration of run.sh, its online stream sent by the bench
# client, and its 40 offline requests as an OpenAI Batch file submitted with
# `preempt-serve batch submit` at the same moment (the job sends them through
# a Serve handle, at most batch.max_concurrency at a time).  An engine-stats
# sampler gives the offline tokens generated while the online stream lasts.
# Needs run.sh's results in $OUT (online-only, offline-only, vllm++).
# Usage: bash studies/conserve_live/batch.sh   (env N, RATE, OFF, CAP, OUT)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=disabled
N=${N:-60}; RATE=${RATE:-0.35}; OFF=${OFF:-40}; CAP=${CAP:-320}
OUT=${OUT:-studies/conserve_live}
CFG=studies/configs/coserve_conserve.yaml
source studies/serve_lib.sh
sampler=
cleanup() { [ -n "$sampler" ] && kill "$sampler" 2>/dev/null; stop_server; }
trap cleanup EXIT
python -m studies.conserve_live.batch make-file "$OUT/conserve-batch.input.jsonl" "$OFF"
start_server "$CFG" "$OUT/conserve-batch.server.log"
python -m studies.conserve_live.batch sample "$OUT/conserve-batch.samples.json" &
sampler=$!
sleep 3
preempt-serve batch submit "$OUT/conserve-batch.input.jsonl" --config "$CFG" --wait \
  > "$OUT/conserve-batch.submit.log" 2>&1 &
submit=$!
date +%s.%N > "$OUT/conserve-batch.start"
python -m bench run --base-url http://127.0.0.1:8000/v1 --dataset sharegpt --max-total-len "$CAP" \
  --seed 0 --rate "$RATE" --max-duration 1800 --request-timeout 1800 --system conserve-batch \
  -n "$N" --save-records --out "$OUT/conserve-batch.json"
wait "$submit"
kill "$sampler"; sampler=
cat "$OUT/conserve-batch.submit.log"
cp "$(grep -o '/[^ ]*output.jsonl' "$OUT/conserve-batch.submit.log" | tail -1)" \
  "$OUT/conserve-batch.output.jsonl"
python -m studies.conserve_live.batch summarize "$OUT"
