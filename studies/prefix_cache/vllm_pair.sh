#!/usr/bin/env bash
# The shared-system-prompt workload against our server and vLLM-CPU (its
# automatic prefix caching is on by default), one after the other, bfloat16
# on both sides, each server started afresh for each run, so that no run
# finds the system prompt cached by an earlier one (studies/prefix_cache/
# README.md, "Against vLLM-CPU"):
#   rate:  Poisson at RATE, our shipped configuration with the cache (on.yaml);
#   burst: N_INF requests at once, studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml
#          (vLLM's batch limits, admission control off), as the engine pairs there.
# vLLM runs in its own venv (PEERS.md; studies/engine_cpu/vllm_cpu/README.md).
#   PARTS="vllm_rate ours_rate vllm_burst ours_burst" \
#     bash studies/prefix_cache/vllm_pair.sh [N] [RATE] [PREFIX] [N_INF]
source "$(dirname "$0")/common.sh"
N_INF=${N_INF:-${4:-100}}
PARTS=${PARTS:-vllm_rate ours_rate vllm_burst ours_burst}
OUT=${OUT:-studies/prefix_cache/vllm_pair}
mkdir -p "$OUT"
trap 'stop_server; vllm_stop' EXIT
M=/root/.cache/peer-vllm/smollm2-bf16
vp=
vllm_stop() {
  [ -n "$vp" ] || return 0
  pkill -TERM -f "vllm serve" || true; sleep 5; pkill -9 -f "vllm serve" || true
  pkill -9 -f EngineCore || true; wait "$vp" 2>/dev/null || true; vp=
}
vllm() {  # NAME BENCH-ARGS...
  local name=$1; shift
  ( . ~/.cache/peer-vllm/venv/bin/activate; export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1
    cd ~/.cache/peer-vllm
    exec vllm serve $M --port 8011 --dtype bfloat16 --max-model-len 2048 \
      --gpu-memory-utilization 0.3 ) > "$OUT/$name.server.log" 2>&1 &
  vp=$!
  for _ in $(seq 1 150); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 2; done
  python -m bench run --base-url http://127.0.0.1:8011/v1 --model $M "${work[@]}" "$@" \
    --system vllm-cpu --out "$OUT/$name.json" > "$OUT/$name.log"
  sleep 11  # its stats line (every 10 s) with the prefix cache's hit rate
  grep -o "Prefix cache hit rate: [0-9.]*%" "$OUT/$name.server.log" | tail -1 \
    > "$OUT/$name.prefix_hits.txt" || true
  vllm_stop
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
