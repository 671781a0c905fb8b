#!/usr/bin/env bash
# ShareGPT prompts behind one shared system prompt, against the shipped
# configuration with and without prefix caching, alternated ROUNDS times so
# that the machine's drift hits both alike (studies/prefix_cache/README.md).
#   bash studies/prefix_cache/run.sh [N] [RATE] [PREFIX] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/serve_lib.sh
N=${N:-${1:-200}}
RATE=${RATE:-${2:-1.0}}
PREFIX=${PREFIX:-${3:-512}}
ROUNDS=${ROUNDS:-${4:-2}}
OUT=${OUT:-studies/prefix_cache/runs_rate${RATE}}
mkdir -p "$OUT"
export RAY_AUTH_MODE=disabled
trap stop_server EXIT
for round in $(seq 1 "$ROUNDS"); do
  for system in on off; do
    start_server "studies/prefix_cache/$system.yaml" "$OUT/$system-$round.server.log"
    python -m bench run --base-url http://127.0.0.1:8000/v1 --rate "$RATE" -n "$N" \
      --shared-prefix "$PREFIX" --seed 5 --max-prompt-len 512 --max-total-len 1024 \
      --save-records --system "prefix_caching_$system" --out "$OUT/$system-$round.json" \
      > "$OUT/$system-$round.log"
    python -c "import json, sys; from bench.server_stats import RayStatsSource
json.dump(RayStatsSource().engines(), open(sys.argv[1], 'w'), indent=1, default=str)" \
      "$OUT/$system-$round.engine.json" || true
    stop_server
  done
done
python -m studies.prefix_cache.report "$OUT" | tee "$OUT/report.txt"
