#!/bin/bash
# The 100-request burst of triple.sh on our server alone, under the skip-join MLFQ and under
# FCFS in turn (serve_b128_bf16.yaml, serve_b128_bf16_fcfs.yaml), each freshly started:
# every request's token times and every iteration's plan (`bench trace-live`) kept.
#   bash studies/engine_cpu/vllm_cpu/burst_policy.sh TAG [ROUNDS]
# writes burst_{mlfq,fcfs}_TAG_R.json and burst_{mlfq,fcfs}_TAG_R.trace.json.gz here.
# POLICIES=mlfq runs one policy only.  ISOLATE=1 moves every other process of the machine
# (Ray's, the proxy, the ingress, the client) off the engine replica's cores once it is up.
set -u
TAG=$1; ROUNDS=${2:-1}
cd "$(dirname "$0")/../../.."
. studies/serve_lib.sh
OUTD=studies/engine_cpu/vllm_cpu
isolate() {  # every process but the engine replica onto the cores it is not pinned to
  local ep cores others
  ep=$(pgrep -f "ServeReplica:llm:Engine" | head -1)
  cores=$(python -c "import os; print(','.join(map(str, sorted(os.sched_getaffinity($ep)))))")
  others=$(python -c "import os; e={$cores}; print(','.join(str(c) for c in range(os.cpu_count()) if c not in e))")
  for p in $(ps -eo pid=); do
    [ "$p" = "$ep" ] || taskset -a -p -c "$others" "$p" >/dev/null 2>&1
  done
  echo "engine on cores $cores, everything else on $others"
}
one() {  # POLICY CONFIG ROUND
  RAY_AUTH_MODE=disabled start_server $OUTD/$2 ${LOGDIR:-/tmp}/burst_$1_${TAG}_$3.log
  [ "${ISOLATE:-0}" = 1 ] && isolate
  python -m bench run --dataset sharegpt -n 100 --rate inf --seed 0 --base-url http://127.0.0.1:8000/v1 \
    --endpoint completions --max-duration 540 --system preempt-serve --save-records \
    --out $OUTD/burst_$1_${TAG}_$3.json 2>&1 | tail -1
  RAY_AUTH_MODE=disabled python -m bench trace-live --out $OUTD/burst_$1_${TAG}_$3.trace.json.gz 2>&1 | tail -1
  stop_server
  [ "${ISOLATE:-0}" = 1 ] && for p in $(ps -eo pid=); do taskset -a -p -c "0-$(($(nproc --all) - 1))" "$p" >/dev/null 2>&1; done
  return 0
}
for r in $(seq 1 "$ROUNDS"); do
  for policy in ${POLICIES:-mlfq fcfs}; do
    cfg=serve_b128_bf16.yaml; [ "$policy" = fcfs ] && cfg=serve_b128_bf16_fcfs.yaml
    one "$policy" "$cfg" "$r"
  done
done
