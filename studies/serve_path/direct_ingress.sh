#!/bin/bash
# An idle server's first token through Serve's HTTP proxy and through the ingress replica's own
# HTTP server (Ray Serve's direct ingress), on one server; the CPU of streaming through each;
# whether each comes back after its ingress replica dies; vLLM-CPU's first token between.
#   bash studies/serve_path/direct_ingress.sh        # writes studies/serve_path/direct_ingress/
# Needs vLLM-CPU's venv (studies/engine_cpu/vllm_cpu/README.md, "Exact commands").
set -u
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
export RAY_AUTH_MODE=disabled
OUTD=${OUTD:-studies/serve_path/direct_ingress}; mkdir -p $OUTD
CFG=studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml
# Direct ingress on 8100 beside the proxy on 8000 (the config's port). The 30 s draining
# period and the port quarantine are for a load balancer in front; there is none here.
# (The upper bound is exclusive: 8100 alone.)
DIRECT=(RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8100
  RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=8101 RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=0
  RAY_SERVE_PORT_QUARANTINE_S=0)
date -u +%H:%M:%S
export "${DIRECT[@]}"
start_server $CFG ${LOGDIR:-/tmp}/direct_ingress_1.log
wait_healthy http://127.0.0.1:8100/health 30
python -m studies.serve_path.idle_hops --entries proxy=8000,direct=8100 --lens 16,128 \
  --reps 20 --out $OUTD/idle_hops.json
for r in p1 d1 p2 d2; do
  case $r in p*) port=8000 ;; d*) port=8100 ;; esac
  python -m studies.serve_path.stream_cpu -n 160 --max-tokens 64 --stream --label $r \
    --url http://127.0.0.1:$port/v1/chat/completions --out $OUTD/stream_cpu.jsonl
done
python -m studies.serve_path.ingress_restart --port 8100 --entries proxy=8000,direct=8100 \
  --out $OUTD/restart_direct.json
stop_server
unset "${DIRECT[@]%%=*}"
date -u +%H:%M:%S
# The same kills without direct ingress: the proxy alone.
start_server $CFG ${LOGDIR:-/tmp}/direct_ingress_2.log
python -m studies.serve_path.ingress_restart --port 8000 --entries proxy=8000 \
  --out $OUTD/restart_proxy.json
stop_server
date -u +%H:%M:%S
vllm_first_tokens $OUTD/vllm_cpu.json ${LOGDIR:-/tmp}/direct_ingress_vllm.log 20
date -u +%H:%M:%S
