#!/usr/bin/env bash
# ShareGPT prompts behind one shared system prompt, against the shipped
# configuration with and without prefix caching, alternated ROUNDS times so
# that the machine's drift hits both alike (studies/prefix_cache/README.md).
#   bash studies/prefix_cache/run.sh [N] [RATE] [PREFIX] [ROUNDS]
source "$(dirname "$0")/common.sh"
ROUNDS=${ROUNDS:-${4:-2}}
OUT=${OUT:-studies/prefix_cache/runs_rate${RATE}}
mkdir -p "$OUT"
trap stop_server EXIT
for round in $(seq 1 "$ROUNDS"); do
  for system in on off; do
    start_server "studies/prefix_cache/$system.yaml" "$OUT/$system-$round.server.log"
    python -m bench run --base-url http://127.0.0.1:8000/v1 "${work[@]}" --rate "$RATE" \
      -n "$N" --system "prefix_caching_$system" --out "$OUT/$system-$round.json" \
      > "$OUT/$system-$round.log"
    dump_engine_stats "$OUT/$system-$round.engine.json"
    stop_server
  done
done
python -m studies.prefix_cache.report "$OUT" | tee "$OUT/report.txt"
