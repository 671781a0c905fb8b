#!/bin/bash
# Idle servers' time to first token by prompt length (prefill_probe.py): our
# server (serve_b128_bf16.yaml), vLLM-CPU, our server again, each freshly
# started, bf16, one engine core each (README "Exact commands" for vLLM's venv).
#   bash studies/engine_cpu/vllm_cpu/prefill_probe.sh TAG
# writes prefill_TAG_{ours_1,vllm,ours_2}.json here.  PROFILE=1 also runs vLLM with its
# torch profiler over three 1,024-token prompts and prints where its forward
# passes' time goes (vllm_profile.py; PROFILE_LEN=N: N-token prompts instead);
# servers' logs under $LOGDIR (/tmp).
set -u
TAG=$1
cd "$(dirname "$0")/../../.."
. studies/serve_lib.sh
OUTD=studies/engine_cpu/vllm_cpu
PROBE="python $OUTD/prefill_probe.py"
ours() {
  RAY_AUTH_MODE=disabled start_server $OUTD/serve_b128_bf16.yaml ${LOGDIR:-/tmp}/prefill_${TAG}_ours_$1.log
  $PROBE --base-url http://127.0.0.1:8000/v1 --out $OUTD/prefill_${TAG}_ours_$1.json
  stop_server
}
ours 1
VM=$VLLM_MODEL
PROF=${LOGDIR:-/tmp}/vllm_profile_$TAG
EXTRA=(); [ -n "${PROFILE:-}" ] && EXTRA=(--profiler-config "{\"profiler\":\"torch\",\"torch_profiler_dir\":\"$PROF\"}")
start_vllm bfloat16 ${LOGDIR:-/tmp}/prefill_${TAG}_vllm.log "${EXTRA[@]}"
$PROBE --base-url http://127.0.0.1:8011/v1 --model $VM --out $OUTD/prefill_${TAG}_vllm.json
if [ -n "${PROFILE:-}" ]; then
  curl -sf -X POST http://127.0.0.1:8011/start_profile
  $PROBE --base-url http://127.0.0.1:8011/v1 --model $VM --lens ${PROFILE_LEN:-1024} --reps 3 --seed 5
  curl -sf -X POST http://127.0.0.1:8011/stop_profile; sleep 20
  python $OUTD/vllm_profile.py $PROF
fi
stop_vllm
ours 2
