#!/usr/bin/env bash
# Admission under skip-join MLFQ: the FCFS reading of the queue (serve_config.yaml as
# shipped, run "old") against the per-queue wait with 10 s and 3 s of queued work at most
# (serve_backlog10.yaml, serve_backlog3.yaml), each run on a fresh server, the same client:
#  - bursts: 300 ShareGPT requests, Gamma arrivals CV 3 at 1.2 req/s, the run in which
#    the shipped admission refused 11 requests that vLLM-CPU served within a 2 s TTFT
#    (studies/latency_vs_vllm);
#  - overload: 5x a capacity of 0.59 req/s for 300 s (studies/hardening's overload run,
#    its capacity given rather than probed, so that every configuration is offered the
#    same arrivals).
#   RUNS="remaining backlog10r" bash studies/admission_mlfq/run.sh [bursts] [overload]
# writes runs/RUN_{bursts,overload}.json.gz (+ the overload's plot) in this folder.
set -u
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
OUTD=studies/admission_mlfq/runs
mkdir -p $OUTD
# old, remaining: serve_config.yaml as shipped; backlog10r: serve_backlog10.yaml (the
# recorded runs: old, backlog10 and backlog3 before the queued work counted a job past its
# expected length as having some left, remaining and backlog10r after).
config() {
  case $1 in
    old|remaining) echo serve_config.yaml ;;
    backlog10r) echo studies/admission_mlfq/serve_backlog10.yaml ;;
    *) echo studies/admission_mlfq/serve_$1.yaml ;;
  esac
}
for phase in ${*:-bursts overload}; do
  for run in ${RUNS:-remaining backlog10r}; do
    date -u +"%H:%M $phase $run"
    RAY_AUTH_MODE=disabled start_server "$(config $run)" /tmp/${run}_$phase.log
    if [ "$phase" = bursts ]; then
      python -m bench run --dataset sharegpt -n 300 --rate 1.2 --cv 3 --seed 0 \
        --base-url http://127.0.0.1:8000/v1 --endpoint completions --system $run \
        --max-duration 3000 --request-timeout 3000 --save-records \
        --out $OUTD/${run}_bursts.json 2>&1 | grep -E "throughput|wrote" | head -3
    else
      python -m bench overload --base-url http://127.0.0.1:8000/v1 --factor 5 --duration 300 \
        --capacity 0.59 --drain-timeout 600 --system $run --save-records \
        --out $OUTD/${run}_overload.json --plot $OUTD/${run}_overload.png 2>&1 | tail -2
    fi
    stop_server
    gzip -9f $OUTD/${run}_$phase.json
  done
done
date -u +%H:%M
