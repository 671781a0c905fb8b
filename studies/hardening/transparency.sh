#!/usr/bin/env bash
# Preemption transparency on the live server (README.md "Preemption transparency"):
# `python -m bench transparency` against the tight-KV MLFQ configuration, with its
# default execution and with a batch-variant one (deterministic mode off, plain weights).
#   bash studies/hardening/transparency.sh [TAG]
set -euo pipefail
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
tag=${1:-$(date -u +%Y-%m-%d)}
out=studies/hardening
trap stop_server EXIT
for cfg in mlfq_tight_kv mlfq_tight_kv_variant; do
  start_server "studies/configs/$cfg.yaml" "/tmp/transparency_$cfg.log"
  python -m bench transparency --base-url http://127.0.0.1:8000/v1 --probes 16 \
    --disruptors 16 --disruptor-output-len 128 --out "$out/transparency_${cfg}_$tag.json" || true
  stop_server
done
