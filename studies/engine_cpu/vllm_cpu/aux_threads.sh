#!/bin/bash
# Our server (serve_b128_bf16.yaml: the engine replica pinned to one core, its threads at
# nice -10) on the 100-request ShareGPT burst, each run freshly started, with the replica's
# threads other than its loop (Ray's and Serve's, the one that streams tokens) left where they
# are or moved to core 1 once it is up:
#   bash studies/engine_cpu/vllm_cpu/aux_threads.sh base:b1 aux:a1 iso:i1 base:b2 aux:a2 iso:i2
# base: as shipped; aux: every thread of the replica but the loop's on core 1; iso: aux, and
# every other Ray / Serve / Python process and the client on core 1 too.  Writes
# aux_threads/TAG.json (the run) and prints the loop thread's time on and waiting for its
# core over the run (/proc/PID/task/TID/schedstat) and the other threads' time on a core.
set -u
cd "$(dirname "$0")/../../.."
. studies/serve_lib.sh
OUTD=studies/engine_cpu/vllm_cpu/aux_threads
run() {  # MODE TAG
  local mode=$1 tag=$2
  RAY_AUTH_MODE=disabled start_server studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml \
    ${LOGDIR:-/tmp}/aux_threads_$tag.log
  local ep lt
  ep=$(pgrep -f 'ServeReplica.*Engine' | head -1)
  lt=$(py-spy dump -p "$ep" | grep '"engine-loop"' | awk '{print $2}')
  if [ "$mode" != base ]; then
    for t in /proc/$ep/task/*; do [ "$(basename $t)" = "$lt" ] || taskset -pc 1 "$(basename $t)" >/dev/null; done
  fi
  if [ "$mode" = iso ]; then
    for p in $(pgrep -f 'ray|serve|python'); do
      [ "$p" = "$ep" ] && continue
      for t in /proc/$p/task/*; do taskset -pc 1 "$(basename $t)" >/dev/null 2>&1; done
    done
  fi
  snap() { for t in /proc/$ep/task/*; do echo "$(basename $t) $(cut -d' ' -f1,2 $t/schedstat)"; done; }
  snap > /tmp/aux_threads_before
  local cl=""; [ "$mode" = iso ] && cl="taskset -c 1"
  $cl python -m bench run --dataset sharegpt -n 100 --rate inf --seed 0 \
    --base-url http://127.0.0.1:8000/v1 --endpoint completions --max-duration 540 \
    --system "preempt-serve $mode" --out $OUTD/$tag.json > /dev/null 2>&1
  snap > /tmp/aux_threads_after
  python - "$OUTD/$tag.json" "$lt" <<'PY'
import json, sys
path, lt = sys.argv[1], sys.argv[2]
read = lambda f: {l.split()[0]: [int(x) for x in l.split()[1:]] for l in open(f)}
b, a = read("/tmp/aux_threads_before"), read("/tmp/aux_threads_after")
d = {t: [x - y for x, y in zip(v, b[t])] for t, v in a.items() if t in b}
other = sum(v[0] for t, v in d.items() if t != lt)
s = json.load(open(path))["summary"]
print(f"{path}: {s['output_token_throughput']:.1f} output tok/s; loop thread on its core "
      f"{d[lt][0] / 1e9:.1f} s, waiting for it {d[lt][1] / 1e9:.1f} s; other threads "
      f"{other / 1e9:.1f} s")
PY
  stop_server
}
for spec in "$@"; do run "${spec%:*}" "${spec#*:}"; done
