#!/bin/bash
# How many streamed tokens a second Serve's HTTP proxy and one ingress carry, with every
# token sent (stream_interval 1) and 8 at a time (stream_interval 8): the server of
# serve_b128_bf16.yaml (studies/engine_cpu/vllm_cpu/) on a random-weight Llama small enough
# (tiny_model.py) that its engine makes tokens faster than the path streams them. Each run:
# a freshly started server, a warm-up, then N chat completions (ignore_eos, MAX_TOKENS
# tokens each, greedy, CONC at a time) streamed, then the same not streamed (one response a
# request: the path's bound without a message a token); every Serve process's CPU
# (studies/serve_path/stream_cpu.py).
#   bash studies/stream_interval/ceiling.sh [RUNS]   # RUNS: e.g. "i1:a i8:a i1:b i8:b" (default)
# appends to ceiling.jsonl here; the model and configs under $LOGDIR (/tmp).
set -u
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
export RAY_AUTH_MODE=disabled
OUTD=studies/stream_interval
TMPD=${LOGDIR:-/tmp}
MODEL=$TMPD/tiny_llama_49k
N=${N:-512} CONC=${CONC:-128} MAX_TOKENS=${MAX_TOKENS:-256}
[ -f $MODEL/model.safetensors ] || python -m studies.stream_interval.tiny_model $MODEL
for i in 1 8; do
  sed -e "s|^    model: .*|    model: $MODEL\n    served_model_name: smollm2|" \
    -e "s/^    engine_num_cpus: 1$/&\n    stream_interval: $i/" \
    studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml > $TMPD/ceiling_i$i.yaml
done
load() {  # LABEL [--stream]
  python -m studies.serve_path.stream_cpu -n $N --concurrency $CONC --max-tokens $MAX_TOKENS \
    --temperature 0 --label "$1" "${@:2}" --out $OUTD/ceiling.jsonl
  tail -1 $OUTD/ceiling.jsonl | cut -c1-160
}
for run in ${1:-i1:a i8:a i1:b i8:b}; do
  kind=${run%%:*}; tag=${run#*:}
  date -u +"%H:%M:%S $kind $tag"
  start_server $TMPD/ceiling_$kind.yaml $TMPD/ceiling_${kind}_$tag.log
  python -m studies.serve_path.stream_cpu -n 64 --concurrency 32 --max-tokens 32 --stream \
    --out /dev/null
  load "${kind}_${tag}_stream" --stream
  load "${kind}_${tag}_whole"
  stop_server
done
date -u +%H:%M:%S
