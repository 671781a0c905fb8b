#!/usr/bin/env bash
# Live: the shipped serve_config.yaml without and with speculative decoding
# (num_tokens 4), one after the other, each offered the same ShareGPT chat
# stream (Poisson, RATE req/s, N requests, answers ending by themselves up
# to 256 tokens, TEMPERATURE).
#   bash studies/speculative/run_live.sh [OUT_DIR] [RATE] [N] [TEMPERATURE]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-runs/speculative-live}
rate=${2:-0.5}
n=${3:-60}
temp=${4:-0}
mkdir -p "$out"
source studies/serve_lib.sh
cp serve_config.yaml "$out/off.yaml"
cp serve_config.yaml "$out/on.yaml"
printf '      speculative:\n        num_tokens: 4\n' >> "$out/on.yaml"
trap stop_server EXIT
for mode in off on; do
  start_server "$out/$mode.yaml" "$out/$mode.log"
  python -m bench run --dataset sharegpt -n "$n" --rate "$rate" --seed 1 --endpoint chat \
    --temperature "$temp" --max-tokens 256 --system "spec-$mode" \
    --out "$out/$mode-t$temp.json"
  dump_engine_stats "$out/$mode-t$temp-engine.json"
  stop_server
done
