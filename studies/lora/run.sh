#!/usr/bin/env bash
# The live LoRA study: a random adapter of SmolLM2, the server with it
# (float32, so the parity with PEFT is exact), then studies/lora/live.py.
#   bash studies/lora/run.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-runs/lora}
mkdir -p "$out"
out=$(cd "$out" && pwd)
source studies/serve_lib.sh
python -m studies.lora.make_adapter "$out/adapter"
sed 's/      dtype: auto/      dtype: float32/' serve_config.yaml > "$out/serve.yaml"
printf '      lora_adapters:\n        smol-lora: %s\n' "$out/adapter" >> "$out/serve.yaml"
trap stop_server EXIT
start_server "$out/serve.yaml" "$out/serve.log"
python -m studies.lora.live "$out/adapter" "$out/results.json"
