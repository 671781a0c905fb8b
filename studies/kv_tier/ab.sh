#!/usr/bin/env bash
# The host KV tier before and after fetches stopped queuing behind stores, live: FCFS and MLFQ
# (studies/econoserve_live/{fcfs,mlfq}.yaml: 2,048-token device cache, proactive swapping to
# the object store), chat requests of ShareGPT prompts answered to their end (temperature 0.7,
# cap 256, seed 0, Poisson at RATE), as studies/econoserve_live/head.sh runs them.  `before`
# runs the tier of commit BEFORE (kvstore/tier.py as it was there, put in place for the run and
# restored after), `after` this tree's; rounds alternate before and after, each run on a freshly
# started server.  Writes runs/<variant>_<policy>_<round>.{json,trace.json.gz,stats.json}.
# Usage: bash studies/kv_tier/ab.sh [ROUNDS] [RATE] [N]   (env BEFORE, POLICIES, OUT, FIRST: the
#   first round's number)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=disabled
ROUNDS=${1:-2}; RATE=${2:-2.0}; N=${3:-150}
BEFORE=${BEFORE:-4d15f3f}
POLICIES=${POLICIES:-fcfs mlfq}
OUT=${OUT:-studies/kv_tier}
git diff --quiet -- kvstore/tier.py || { echo "kvstore/tier.py has local changes" >&2; exit 1; }
mkdir -p "$OUT/runs"
source studies/serve_lib.sh
restore() { stop_server; git checkout -- kvstore/tier.py; }
trap restore EXIT
for round in $(seq "${FIRST:-1}" $((${FIRST:-1} + ROUNDS - 1))); do
  for variant in before after; do
    if [ "$variant" = before ]; then git show "$BEFORE:kvstore/tier.py" > kvstore/tier.py
    else git checkout -- kvstore/tier.py; fi
    for policy in $POLICIES; do
      run=$OUT/runs/${variant}_${policy}_$round
      start_server "studies/econoserve_live/$policy.yaml" "/tmp/kv_tier_server.log"
      python -m bench run --base-url http://127.0.0.1:8000/v1 --system "$variant-$policy" \
        --endpoint chat --dataset sharegpt -n "$N" --max-total-len 1024 --seed 0 \
        --rate "$RATE" --max-tokens 256 --temperature 0.7 --max-duration 3600 \
        --request-timeout 3600 --save-records --out "$run.json" > /dev/null
      python -m bench trace-live --out "$run.trace.json.gz"
      dump_engine_stats "$run.stats.json"
      stop_server
    done
  done
done
