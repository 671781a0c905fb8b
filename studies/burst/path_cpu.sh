#!/bin/bash
# serve_b128_bf16.yaml started, `python -m studies.burst.path_cpu` against it, stopped:
#   bash studies/burst/path_cpu.sh [OUT [ARGS…]]   (default studies/burst/path_cpu.json;
#   ARGS go to path_cpu.py, e.g. --fixed 16 1)
set -u
cd "$(dirname "$0")/../.."
. studies/serve_lib.sh
RAY_AUTH_MODE=disabled start_server studies/engine_cpu/vllm_cpu/serve_b128_bf16.yaml \
  ${LOGDIR:-/tmp}/path_cpu_server.log
python -m studies.burst.path_cpu --out "${1:-studies/burst/path_cpu.json}" "${@:2}"
stop_server
