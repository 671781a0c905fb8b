#!/bin/bash
# `admission.dispatch_ahead` on and off under load: ShareGPT answers of their full lengths at
# Poisson 0.9 req/s (vLLM-CPU beside, after the first of ours) and in bursts (Gamma CV 3) at
# 1.2 req/s, 300 requests a run, each on a fresh server (studies/latency_vs_vllm/run.sh).
#   bash studies/serve_path/dispatch_ahead_load.sh    # writes studies/serve_path/dispatch_ahead/load/
#   python -m studies.serve_path.load_table studies/serve_path/dispatch_ahead/load
set -u
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
export OUTD=studies/serve_path/dispatch_ahead/load
OFF=$(serve_config_with "admission: {dispatch_ahead: false}")
OURS=ahead_on bash studies/latency_vs_vllm/run.sh 300 1 0.9
CONFIG=$OFF OURS=ahead_off ONLY=ours bash studies/latency_vs_vllm/run.sh 300 1 0.9
OURS=ahead_on ONLY=ours bash studies/latency_vs_vllm/run.sh 300 3 1.2
CONFIG=$OFF OURS=ahead_off ONLY=ours bash studies/latency_vs_vllm/run.sh 300 3 1.2
rm -f $OFF
