#!/bin/bash
# Idle servers' time to first token by prompt length, ours (serve_b128_bf16.yaml)
# and vLLM-CPU up at once, bf16, one engine core each, taking turns prompt by
# prompt (prefill_probe.py --other-base-url), so that a shared host's phases
# fall on both alike; vLLM's venv as in README "Exact commands".
#   REPS=15 bash studies/engine_cpu/vllm_cpu/prefill_alternated.sh TAG
# writes prefill_alternated_TAG.json here; servers' logs under $LOGDIR (/tmp).
set -u
TAG=$1
cd "$(dirname "$0")/../../.."
. studies/serve_lib.sh
OUTD=studies/engine_cpu/vllm_cpu
LOGS=${LOGDIR:-/tmp}/alternated_$TAG
RAY_AUTH_MODE=disabled start_server $OUTD/serve_b128_bf16.yaml ${LOGS}_ours.log
start_vllm bfloat16 ${LOGS}_vllm.log
python $OUTD/prefill_probe.py --base-url http://127.0.0.1:8000/v1 \
  --other-base-url http://127.0.0.1:8011/v1 --other-model $VLLM_MODEL --reps "${REPS:-15}" \
  --out $OUTD/prefill_alternated_$TAG.json
stop_vllm
stop_server
