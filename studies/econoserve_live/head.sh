#!/usr/bin/env bash
# EconoServe live with its length estimates from the predictor (econoserve.yaml), from the
# engine's length head (econoserve-head.yaml: no predictor), or from both, the head's replacing
# the predictor's at the first token (econoserve-head-predictor.yaml: the predictor's CPU cost
# without its estimates after the first token), answers ending by themselves: chat requests of
# ShareGPT prompts, sampled (temperature 0.7), each capped at CAP tokens, Poisson at RATE.
# Each on a freshly started server, one after the other; then, per run, how close the
# estimates each request got were to its answer (summary in head_summary_RATE.json).  Each
# run also keeps its plan trace and the cost table of its iterations (swap costs from TABLE),
# as run.sh's do: the host's speed during the run (bench trace-summary), and a cost table for
# replays (natural_replay.sh: `bench simulate --lengths-from RUN.json` replays the answers at
# the lengths they came out).
# Usage: bash studies/econoserve_live/head.sh [N] [RATE]   (env CAP, OUT, CONFIGS, TABLE, SEED)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=disabled
N=${1:-40}; RATE=${2:-0.15}
CAP=${CAP:-256}
OUT=${OUT:-studies/econoserve_live}
CONFIGS=${CONFIGS:-econoserve econoserve-head econoserve-head-predictor}
TABLE=${TABLE:-studies/validation/cost_table_live.json}
mkdir -p "$OUT/runs"
source studies/serve_lib.sh
trap stop_server EXIT
runs=()
for config in $CONFIGS; do
  run=$OUT/runs/${config}_natural_$RATE
  start_server "studies/econoserve_live/$config.yaml" "$OUT/runs/$config.natural.server.log"
  python -m bench run --base-url http://127.0.0.1:8000/v1 --system "$config" --endpoint chat \
    --dataset sharegpt -n "$N" --max-total-len 1024 --seed "${SEED:-0}" --rate "$RATE" \
    --max-tokens "$CAP" --temperature 0.7 \
    --max-duration 3600 --request-timeout 3600 --save-records --out "$run.json"
  python -m bench trace-live --out "$run.trace.json.gz"
  python -m bench profile-live --swaps-from "$TABLE" --out "$run.cost.json" > /dev/null
  stop_server
  runs+=("$run.json")
done
python - "$CAP" "$OUT/head_summary_$RATE.json" "${runs[@]}" <<'PY'
import json, sys
from studies.econoserve_live.natural_table import estimates
cap, out, paths = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
summary = {}
for path in paths:
    d = json.load(open(path))
    recs = [r for r in d["records"] if r.get("error") is None]
    summary[d["meta"].get("system") or path] = {
        "requests": len(recs), "capped": sum(r["output_tokens"] >= cap for r in recs),
        **estimates(recs, cap)}
json.dump(summary, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
