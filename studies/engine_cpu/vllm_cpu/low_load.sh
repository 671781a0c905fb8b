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
( . ~/.cache/peer-vllm/venv/bin/activate; export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1;
  cd ~/.cache/peer-vllm; exec vllm serve /root/.cache/peer-vllm/smollm2-bf16 --port 8011 \
    --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.3 ) \
  > ${LOGDIR:-/tmp}/low_vllm_$TAG.log 2>&1 &
vp=$!
for _ in $(seq 1 150); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 2; done
load http://127.0.0.1:8011/v1 /root/.cache/peer-vllm/smollm2-bf16 vllm-cpu $OUTD/low_${TAG}_vllm.json
pkill -TERM -f "vllm serve"; sleep 5; pkill -9 -f "vllm serve"; pkill -9 -f EngineCore
wait $vp 2>/dev/null
date -u +%H:%M
