#!/bin/bash
# Our server / vLLM-CPU / our server, each freshly started, on 100 ShareGPT
# requests at once (serve_b128*.yaml; vLLM in its venv, README "Exact commands").
#   bash studies/engine_cpu/vllm_cpu/triple.sh bfloat16|float32 TAG [ours]
# writes ours_b128_TAG_{1,2}.json (+ _engine_stats.json: the engine's stats
# after the run) and vllm_TAG_1.json here; servers' logs under $LOGDIR (/tmp).
# `ours` as a third argument runs our server once, alone.  BENCH_EXTRA=--save-records
# keeps every request's token times in the JSON files.
set -u
DT=$1; TAG=$2
cd "$(dirname "$0")/../../.."
. studies/serve_lib.sh
OUTD=studies/engine_cpu/vllm_cpu
# CONFIG=... picks another of our configs (e.g. serve_b128_bf16_pinned.yaml).
CFG=$OUTD/serve_b128.yaml; [ "$DT" = bfloat16 ] && CFG=$OUTD/serve_b128_bf16.yaml
[ -n "${CONFIG:-}" ] && CFG=$OUTD/$CONFIG
ours() {
  RAY_AUTH_MODE=disabled start_server $CFG ${LOGDIR:-/tmp}/ours_${TAG}_$1.log
  python -m bench run --dataset sharegpt -n 100 --rate inf --seed 0 --base-url http://127.0.0.1:8000/v1 \
    --endpoint completions --max-duration 540 --system preempt-serve ${BENCH_EXTRA:-} --out $OUTD/ours_b128_${TAG}_$1.json 2>&1 | tail -3
  python -c "import json, sys; from bench.server_stats import RayStatsSource
json.dump(RayStatsSource().engines(), open(sys.argv[1], 'w'), indent=1, default=str)" $OUTD/ours_b128_${TAG}_$1_engine_stats.json || true
  stop_server
}
vllm() {
  start_vllm $DT ${LOGDIR:-/tmp}/vllm_$TAG.log
  python -m bench run --dataset sharegpt -n 100 --rate inf --seed 0 --base-url http://127.0.0.1:8011/v1 \
    --endpoint completions --model $VLLM_MODEL --max-duration 540 \
    --system vllm-cpu ${BENCH_EXTRA:-} --out $OUTD/vllm_${TAG}_1.json 2>&1 | tail -3
  stop_vllm
}
case "${3:-triple}" in ours) ours 1 ;; *) date -u +%H:%M; ours 1; date -u +%H:%M; vllm; date -u +%H:%M; ours 2; date -u +%H:%M ;; esac
