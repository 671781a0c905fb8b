#!/usr/bin/env bash
# The shared-system-prompt workload against our server and vLLM-CPU (its
# automatic prefix caching is on by default), one after the other, bfloat16
# on both sides, each server started afresh for each run, so that no run
# finds the system prompt cached by an earlier one (studies/prefix_cache/
# README.md, "Against vLLM-CPU"):
#   rate:  Poisson at RATE, our shipped configuration with the cache (on.yaml);
#   burst: N_INF requests at once, studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml
#          (vLLM's batch limits, admission control off), as the engine pairs there.
# vLLM runs in its own venv, ~/.cache/peer-vllm/venv (set up as in
# studies/engine_cpu/vllm_cpu/README.md, "Exact commands").
#   PARTS="vllm_rate ours_rate vllm_burst ours_burst" \
#     bash studies/prefix_cache/vllm_pair.sh [N] [RATE] [PREFIX] [N_INF]
source "$(dirname "$0")/common.sh"
N_INF=${N_INF:-${4:-100}}
PARTS=${PARTS:-vllm_rate ours_rate vllm_burst ours_burst}
OUT=${OUT:-studies/prefix_cache/vllm_pair}
mkdir -p "$OUT"
trap 'stop_server; [ -z "$vp" ] || stop_vllm' EXIT
vllm() {  # NAME BENCH-ARGS...
  local name=$1; shift
  start_vllm bfloat16 "$OUT/$name.server.log"
  python -m bench run --base-url http://127.0.0.1:8011/v1 --model $VLLM_MODEL "${work[@]}" "$@" \
    --system vllm-cpu --out "$OUT/$name.json" > "$OUT/$name.log"
  sleep 11  # its stats line (every 10 s) with the prefix cache's hit rate
  grep -o "Prefix cache hit rate: [0-9.]*%" "$OUT/$name.server.log" | tail -1 \
    > "$OUT/$name.prefix_hits.txt" || true
  stop_vllm
}
ours() {  # CONFIG NAME BENCH-ARGS...
  local cfg=$1 name=$2; shift 2
  start_server "$cfg" "$OUT/$name.server.log"
  python -m bench run --base-url http://127.0.0.1:8000/v1 "${work[@]}" "$@" \
    --system preempt-serve --out "$OUT/$name.json" > "$OUT/$name.log"
  dump_engine_stats "$OUT/$name.engine.json"
  stop_server
}
for part in $PARTS; do
  case $part in
    vllm_rate) vllm "vllm_rate$RATE" --rate "$RATE" -n "$N" ;;
    ours_rate) ours studies/prefix_cache/on.yaml "ours_rate$RATE" --rate "$RATE" -n "$N" ;;
    vllm_burst) vllm vllm_burst --rate inf -n "$N_INF" ;;
    ours_burst) ours studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml ours_burst \
                  --rate inf -n "$N_INF" ;;
  esac
done
python -m studies.prefix_cache.report "$OUT" | tee "$OUT/report.txt"
