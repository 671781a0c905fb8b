#!/bin/bash
# serve_config.yaml with some product files at two versions, alternated; each step streams
# 160 answers of 64 tokens (24 at a time) twice, then 300 one-token answers, and records each
# Serve process's CPU per request (stream_cpu.py):
#   bash studies/serve_path/path_ab.sh OLD_COMMIT PATH[,PATH…] STEP...
# STEP n1, …: the PATHs as in the working tree; o1, …: as at OLD_COMMIT (both with
# RAY_SERVE_PROXY_USE_GRPC=0); p1, …: as n with
# RAY_SERVE_PROXY_USE_GRPC=1 (the HTTP proxy's calls to the ingress over gRPC as well).
# Appends to $OUT (default studies/serve_path/path_ab.jsonl); the PATHs are restored.
set -u
OLD=$1; IFS=, read -r -a FILES <<< "$2"; shift 2
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
OUT=${OUT:-studies/serve_path/path_ab.jsonl}
KEEP=$(mktemp -d); OLDD=$(mktemp -d)
for i in "${!FILES[@]}"; do
  cp "${FILES[$i]}" "$KEEP/$i"; git show "$OLD:${FILES[$i]}" > "$OLDD/$i"
done
step() {  # STEP VERSION-DIR [ENV=VALUE]
  for i in "${!FILES[@]}"; do cp "$2/$i" "${FILES[$i]}"; done
  env RAY_AUTH_MODE=disabled ${3:-RAY_SERVE_PROXY_USE_GRPC=0} serve run serve_config.yaml \
    > ${LOGDIR:-/tmp}/path_ab_$1.log 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 2; done
  python -m studies.serve_path.stream_cpu -n 48 --max-tokens 64 --stream --offset 1000 > /dev/null
  for r in 1 2; do
    python -m studies.serve_path.stream_cpu -n 160 --max-tokens 64 --stream --label "$1" --out $OUT
  done
  python -m studies.serve_path.stream_cpu -n 300 --concurrency 16 --max-tokens 1 --offset 2000 \
    --label "$1" --out $OUT
  stop_server
}
for s in "$@"; do
  date -u +%H:%M:%S
  case $s in
    n*) step $s "$KEEP" ;;
    o*) step $s "$OLDD" ;;
    p*) step $s "$KEEP" RAY_SERVE_PROXY_USE_GRPC=1 ;;
  esac
done
for i in "${!FILES[@]}"; do cp "$KEEP/$i" "${FILES[$i]}"; done
rm -rf "$KEEP" "$OLDD"
date -u +%H:%M:%S
