# Sourced by run.sh and vllm_pair.sh: what they share.  ShareGPT first turns
# (prompts up to 512 tokens, prompt + answer up to 1,024) behind a
# PREFIX-token system prompt; N requests at RATE (positional or env).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source studies/serve_lib.sh
N=${N:-${1:-200}}
RATE=${RATE:-${2:-1.0}}
PREFIX=${PREFIX:-${3:-512}}
export RAY_AUTH_MODE=disabled
work=(--shared-prefix "$PREFIX" --seed 5 --max-prompt-len 512 --max-total-len 1024
      --endpoint completions --save-records --max-duration 540)
