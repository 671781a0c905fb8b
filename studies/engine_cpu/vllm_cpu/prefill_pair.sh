#!/bin/bash
# Idle servers' time to first token by prompt length with both servers up at
# once, our server (serve_b128_bf16.yaml) and vLLM-CPU, bf16, one engine core
# each, the probe's requests taking turns between them (prefill_probe.py
# --other-url): each ratio from the same minutes of the host.  Both engines
# compute on the last core (`engine_cpu_ids`, VLLM_CPU_OMP_THREADS_BIND),
# both front ends on the others, so that neither's prefill shares its core
# with the other's idle processes.
#   bash studies/engine_cpu/vllm_cpu/prefill_pair.sh TAG [REPS]
# writes prefill_pair_TAG.json here; servers' logs under $LOGDIR (/tmp).
set -u
TAG=$1
cd "$(dirname "$0")/../../.."
. studies/serve_lib.sh
OUTD=studies/engine_cpu/vllm_cpu
CORE=$(( $(nproc) - 1 ))
CONFIG=${LOGDIR:-/tmp}/prefill_pair_${TAG}.yaml
sed "s/^    engine_num_cpus: 1$/&\n    engine_cpu_ids: [$CORE]/" $OUTD/serve_b128_bf16.yaml \
  > $CONFIG
VLLM_CPU_OMP_THREADS_BIND=$CORE start_vllm bfloat16 ${LOGDIR:-/tmp}/prefill_pair_${TAG}_vllm.log
RAY_AUTH_MODE=disabled start_server $CONFIG ${LOGDIR:-/tmp}/prefill_pair_${TAG}_ours.log
python $OUTD/prefill_probe.py --base-url http://127.0.0.1:8000/v1 \
  --other-url http://127.0.0.1:8011/v1 --other-model $VLLM_MODEL --reps "${2:-9}" \
  --out $OUTD/prefill_pair_${TAG}.json
stop_server
stop_vllm
