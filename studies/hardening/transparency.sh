#!/usr/bin/env bash
# Preemption transparency on the live server (README.md, "Overload, disconnects, soak,
# transparency"): `python -m bench transparency` against the tight-KV MLFQ configuration,
# with its default execution (probes apart, then opening with a shared 128-token prefix),
# with a batch-variant one (deterministic mode off, plain weights), and with preemption by
# recomputation instead of swapping.
#   bash studies/hardening/transparency.sh [TAG]
set -euo pipefail
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
tag=${1:-$(date -u +%Y-%m-%d)}
out=studies/hardening
check() {  # NAME [more arguments]
  local name=$1; shift
  python -m bench transparency --base-url http://127.0.0.1:8000/v1 --probes 16 \
    --disruptors 16 --disruptor-output-len 128 "$@" \
    --out "$out/transparency_${name}_$tag.json" || true
}
trap stop_server EXIT
start_server studies/configs/mlfq_tight_kv.yaml /tmp/transparency_mlfq_tight_kv.log
check mlfq_tight_kv
check mlfq_tight_kv_prefix --shared-prefix 128
stop_server
start_server studies/configs/mlfq_tight_kv_variant.yaml /tmp/transparency_variant.log
check mlfq_tight_kv_variant
stop_server
start_server studies/configs/mlfq_tight_kv_recompute.yaml /tmp/transparency_recompute.log
check mlfq_tight_kv_recompute
stop_server
