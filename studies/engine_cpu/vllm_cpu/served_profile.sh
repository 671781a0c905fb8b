#!/bin/bash
# vLLM-CPU, then our server, each freshly started on 100 ShareGPT requests at
# once (bf16, serve_b128_bf16.yaml; vLLM in its venv, README "Exact
# commands"), each server's compute process profiled by `py-spy record
# --native` from 20 s to 45 s of its run; then the split of both
# (served_profile.py).  Raw profiles and runs under $OUT (/tmp/served_profile).
#   N=2 bash studies/engine_cpu/vllm_cpu/served_profile.sh    (writes served_profile_$N.json)
set -u
cd "$(dirname "$0")/../../.."
. studies/serve_lib.sh
OUT=${OUT:-/tmp/served_profile}; mkdir -p $OUT
BENCH=(python -m bench run --dataset sharegpt -n 100 --rate inf --seed 0 --endpoint completions
       --max-duration 540 --save-records)
profile() {  # PID OUTFILE: 25 s of native stacks, 200 a second
  py-spy record --native -r 200 -d 25 -f raw -o "$2" -p "$1" > "$2.log" 2>&1
}
# vLLM: the model runs in its worker process (VLLM::Worker).
start_vllm bfloat16 $OUT/vllm.log
"${BENCH[@]}" --base-url http://127.0.0.1:8011/v1 --model $VLLM_MODEL \
  --system vllm-cpu --out $OUT/vllm_run.json > $OUT/vllm_bench.log 2>&1 &
bp=$!
sleep 20
profile "$(pgrep -f 'VLLM::Worker' | head -1)" $OUT/vllm_raw.txt
wait $bp
stop_vllm
# Ours: the model runs in the Engine replica's process.
RAY_AUTH_MODE=disabled start_server studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml $OUT/ours.log
"${BENCH[@]}" --base-url http://127.0.0.1:8000/v1 --system preempt-serve \
  --out $OUT/ours_run.json > $OUT/ours_bench.log 2>&1 &
bp=$!
sleep 20
profile "$(pgrep -f 'ServeReplica.*Engine' | head -1)" $OUT/ours_raw.txt
wait $bp
stop_server
python -m studies.engine_cpu.vllm_cpu.served_profile --ours $OUT/ours_raw.txt $OUT/ours_run.json \
  --vllm $OUT/vllm_raw.txt $OUT/vllm_run.json --window 20 45 \
  --out studies/engine_cpu/vllm_cpu/served_profile_${N:-1}.json
