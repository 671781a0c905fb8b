#!/bin/bash
# The served burst (100 ShareGPT requests at once, serve_b128_bf16.yaml) with some files of
# the product at two versions, alternated, and vLLM-CPU between (its venv: studies/engine_cpu/
# vllm_cpu/README.md, "Exact commands"):
#   bash studies/burst/served_ab.sh OLD_COMMIT PATH[,PATH…] STEP...
# STEP n1, n2, …: the PATHs as in the working tree; o1, …: as at OLD_COMMIT; v1, …: vLLM-CPU.
# Writes $OUTD/STEP.json (default studies/burst/served_ab; every request's token times); the
# PATHs are restored. With PATH_CPU set (e.g. "--fixed 16 1 -n 200"), our steps run
# `python -m studies.burst.path_cpu $PATH_CPU` instead (where the path's CPU goes, the intake).
# With CLIENT set (a command that takes --base-url, --model and --out, e.g. "python
# studies/engine_cpu/vllm_cpu/prefill_probe.py --lens 16,512"), every step runs it instead.
# OLD_ENV (e.g. "RAY_SERVE_PROXY_USE_GRPC=0") is set for the o steps' server only.
set -u
# The server and the clients that call Ray (path_cpu's trace-live) in one auth mode.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
OLD=$1; IFS=, read -r -a FILES <<< "$2"; shift 2
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
OUTD=${OUTD:-studies/burst/served_ab}; mkdir -p $OUTD
CFG=studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml
KEEP=$(mktemp -d); OLDD=$(mktemp -d)
for i in "${!FILES[@]}"; do
  cp "${FILES[$i]}" "$KEEP/$i"; git show "$OLD:${FILES[$i]}" > "$OLDD/$i"
done
ours() {  # STEP VERSION-DIR [VAR=VALUE…]
  for i in "${!FILES[@]}"; do cp "$2/$i" "${FILES[$i]}"; done
  eval "${3:-} start_server $CFG ${LOGDIR:-/tmp}/served_ab_$1.log"
  if [ -n "${PATH_CPU:-}" ]; then
    python -m studies.burst.path_cpu $PATH_CPU --out $OUTD/$1.json; stop_server; return
  fi
  if [ -n "${CLIENT:-}" ]; then
    $CLIENT --base-url http://127.0.0.1:8000/v1 --out $OUTD/$1.json; stop_server; return
  fi
  python -m bench run --dataset sharegpt -n 100 --rate inf --seed 0 --base-url http://127.0.0.1:8000/v1 \
    --endpoint completions --max-duration 540 --system "preempt-serve $1" --save-records \
    --out $OUTD/$1.json 2>&1 | tail -1
  stop_server
}
vllm() {
  start_vllm bfloat16 ${LOGDIR:-/tmp}/served_ab_$1.log
  if [ -n "${CLIENT:-}" ]; then
    $CLIENT --base-url http://127.0.0.1:8011/v1 --model $VLLM_MODEL --out $OUTD/$1.json
  else python -m bench run --dataset sharegpt -n 100 --rate inf --seed 0 --base-url http://127.0.0.1:8011/v1 \
    --endpoint completions --model $VLLM_MODEL --max-duration 540 \
    --system vllm-cpu --save-records --out $OUTD/$1.json 2>&1 | tail -1
  fi
  stop_vllm
}
for s in "$@"; do
  date -u +%H:%M:%S
  case $s in v*) vllm $s ;; n*) ours $s "$KEEP" ;; o*) ours $s "$OLDD" "${OLD_ENV:-}" ;; esac
done
for i in "${!FILES[@]}"; do cp "$KEEP/$i" "${FILES[$i]}"; done
rm -rf "$KEEP" "$OLDD"
date -u +%H:%M:%S
