#!/usr/bin/env bash
# Co-serving live near 70 % load with the offline work as a batch job through
# Ray Jobs, as a user runs it: for each system a fresh server, the batch file
# (OFF lines of run.sh's offline stream; OFF_ALONE for offline-only) submitted with `preempt-serve batch
# submit --max-concurrency CONC`, and once its first offline tokens are out
# (the job's driver has started) the online ShareGPT stream of N requests at
# RATE req/s.  An engine-stats sampler gives the offline tokens over the
# online stream's span.  Systems:
#   online-only         the online stream alone, FCFS
#   offline-only-batch  the batch job alone, FCFS (for as long as the span)
#   vllm++-batch        both, FCFS, the batch lines at priority 1
#   conserve-batch      both, policy: conserve (default objectives)
#   conserve-batch-tpotT  both, conserve with the TPOT objective T s (TPOT)
# then the comparison (batch70.py).
# Usage: bash studies/conserve_live/batch70.sh
#   (env N, RATE, OFF, OFF_ALONE, CAP, CONC, TPOT, OUT, SYSTEMS)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=disabled
N=${N:-280}; RATE=${RATE:-1.49}; OFF=${OFF:-300}; CAP=${CAP:-320}; CONC=${CONC:-64}
# Offline-only finishes OFF lines well before the span ends: twice as many.
OFF_ALONE=${OFF_ALONE:-$((2 * OFF))}
TPOT=${TPOT:-0.09}; OUT=${OUT:-studies/conserve_live/batch70}
mkdir -p "$OUT"
source studies/serve_lib.sh
sampler=
cleanup() { [ -n "$sampler" ] && kill "$sampler" 2>/dev/null; stop_server; }
trap cleanup EXIT
SYSTEMS=${SYSTEMS-online-only offline-only-batch vllm++-batch conserve-batch conserve-batch-tpot$TPOT}
online=(python -m bench run --base-url http://127.0.0.1:8000/v1 --dataset sharegpt
        --max-total-len "$CAP" --seed 0 --rate "$RATE" --max-duration 1800
        --request-timeout 1800 -n "$N" --save-records)
sed -e '1,2c # Written by studies/conserve_live/batch70.sh: coserve_conserve.yaml, TPOT objective '"$TPOT"' s.' \
    -e 's/^\(      admission:\)$/      conserve:\n        tpot_slo_s: '"$TPOT"'\n\1/' \
    studies/configs/coserve_conserve.yaml > "$OUT/conserve-batch-tpot$TPOT.yaml"
grep -q "tpot_slo_s: $TPOT" "$OUT/conserve-batch-tpot$TPOT.yaml"
run() {  # NAME CONFIG PRIORITY WITH_ONLINE LINES
  local name=$1 cfg=$2 prio=$3 with_online=$4 lines=${5:-$OFF}
  case " $SYSTEMS " in *" $name "*) ;; *) return 0 ;; esac
  start_server "$cfg" "$OUT/$name.server.log"
  if [ "$name" = online-only ]; then
    "${online[@]}" --system "$name" --out "$OUT/$name.json"
  else
    python -m studies.conserve_live.batch make-file "$OUT/$name.input.jsonl" "$lines" "$prio"
    python -m studies.conserve_live.batch sample "$OUT/$name.samples.json" &
    sampler=$!
    preempt-serve batch submit "$OUT/$name.input.jsonl" --config "$cfg" \
      --max-concurrency "$CONC" > "$OUT/$name.submit.log" 2>&1
    python -m studies.conserve_live.batch70 wait-offline "$OUT/$name.samples.json"
    date +%s.%N > "$OUT/$name.start"
    if [ "$with_online" = 1 ]; then
      "${online[@]}" --system "$name" --out "$OUT/$name.json"
    else
      sleep "$(python -m studies.conserve_live.batch70 span "$OUT")"
    fi
    date +%s.%N > "$OUT/$name.end"
    kill "$sampler"; sampler=
  fi
  dump_engine_stats "$OUT/$name.engine.json"
  stop_server
}
run online-only studies/configs/coserve_fcfs.yaml 0 1
run offline-only-batch studies/configs/coserve_fcfs.yaml 0 0 "$OFF_ALONE"
run vllm++-batch studies/configs/coserve_fcfs.yaml 1 1
run conserve-batch studies/configs/coserve_conserve.yaml 0 1
run "conserve-batch-tpot$TPOT" "$OUT/conserve-batch-tpot$TPOT.yaml" 0 1
python -m studies.conserve_live.batch70 summarize "$OUT"
