#!/bin/bash
# Ray Serve's replicas running our code on their own event loop (RAY_SERVE_RUN_USER_CODE_IN_
# SEPARATE_THREAD=0) and their handles' routers on it too (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0),
# against Serve's defaults (a thread and a loop of their own for each), servers alternated
# base loop base loop. Each: an idle server's first token (idle_hops.py, 30 one-token
# completions of 16 and of 128 prompt tokens), then 160 streamed chat answers of 64 tokens, 24 at
# a time, twice, with each Serve process's CPU per request (stream_cpu.py).
#   bash studies/serve_path/serve_loops.sh     # writes studies/serve_path/serve_loops/
set -u
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
export RAY_AUTH_MODE=disabled
OUTD=${OUTD:-studies/serve_path/serve_loops}; mkdir -p $OUTD
for r in ${STEPS:-base1 loop1 base2 loop2}; do
  date -u +%H:%M:%S
  # Only the server's processes: a handle whose router runs on the caller's loop cannot be
  # used outside one, as the clients' (bench trace-live) are.
  case $r in
    base*) start_server serve_config.yaml ${LOGDIR:-/tmp}/serve_loops_$r.log ;;
    loop*) RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 \
             start_server serve_config.yaml ${LOGDIR:-/tmp}/serve_loops_$r.log ;;
  esac
  python -m studies.serve_path.idle_hops --entries $r=8000 --lens 16,128 --reps 30 \
    --out $OUTD/idle_$r.json
  python -m studies.serve_path.stream_cpu -n 48 --max-tokens 64 --stream --offset 1000 > /dev/null
  for k in 1 2; do
    python -m studies.serve_path.stream_cpu -n 160 --max-tokens 64 --stream --label "$r" \
      --out $OUTD/stream_cpu.jsonl
  done
  stop_server
done
date -u +%H:%M:%S
