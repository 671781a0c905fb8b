#!/usr/bin/env bash
# The live runtime-LoRA study: two random adapters of SmolLM2 in a root
# folder, the server with `lora_runtime` on that root (float32, so the
# parity with PEFT is exact), then studies/lora/runtime.py.
#   bash studies/lora/run_runtime.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-runs/lora-runtime}
mkdir -p "$out"
out=$(cd "$out" && pwd)
source studies/serve_lib.sh
python -m studies.lora.make_adapter "$out/root/a" --seed 0
python -m studies.lora.make_adapter "$out/root/b" --seed 1
sed 's/      dtype: auto/      dtype: float32/' serve_config.yaml > "$out/serve.yaml"
printf '      lora_runtime:\n        enabled: true\n        root: %s\n        storage_dir: %s\n' \
  "$out/root" "$out/registry" >> "$out/serve.yaml"
trap stop_server EXIT
start_server "$out/serve.yaml" "$out/serve.log"
python -m studies.lora.runtime "$out/root" "$out/runtime.json"
