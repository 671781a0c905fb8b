#!/bin/bash
# The 100-request ShareGPT burst of the vLLM-CPU pairs (ignore_eos, every request streamed)
# on our server with every token sent as it comes (stream_interval 1, the default) and with
# tokens sent 8 at a time (stream_interval 8), each run freshly started, alternated; the CPU
# each Serve process spent during the burst.
#   bash studies/stream_interval/run.sh [RUNS]   # RUNS: e.g. "i1:a i8:a i1:b i8:b" (default)
# writes burst_{i1,i8}_{a,b}.json and cpu.jsonl here; servers' logs under $LOGDIR (/tmp).
set -u
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
export RAY_AUTH_MODE=disabled
OUTD=studies/stream_interval
declare -A CFG=([i1]=studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml
                [i8]=$OUTD/serve_b128_bf16_interval8.yaml)
for run in ${1:-i1:a i8:a i1:b i8:b}; do
  kind=${run%%:*}; tag=${run#*:}
  date -u +"%H:%M:%S $kind $tag"
  start_server ${CFG[$kind]} ${LOGDIR:-/tmp}/stream_interval_${kind}_$tag.log
  before=$(python -c "import json; from studies.serve_cpu import cpu_s; print(json.dumps(cpu_s()))")
  python -m bench run --dataset sharegpt -n 100 --rate inf --seed 0 \
    --base-url http://127.0.0.1:8000/v1 --endpoint completions --max-duration 540 \
    --system preempt-serve --out $OUTD/burst_${kind}_$tag.json 2>&1 | tail -2
  python -c "import json, sys; from studies.serve_cpu import cpu_s, cpu_diff
print(json.dumps({'run': sys.argv[1], 'cpu_s': cpu_diff(json.loads(sys.argv[2]), cpu_s())}))" \
    "${kind}_$tag" "$before" | tee -a $OUTD/cpu.jsonl
  stop_server
done
date -u +%H:%M:%S
