#!/usr/bin/env bash
# Recompute preemption with the prefix cache looked up again as a job starts
# (studies/prefix_cache/README.md, "Looked up again when a job starts"): the
# FastServe setting of ../fastserve_sim (OPT-13B on an A100-40GB, simulated),
# MLFQ and FCFS with `swap_mode: recompute`, at 4, 6 and 8 req/s, run by the
# tree TREE (this checkout, or a worktree of the commit before the change:
#   git worktree add /tmp/before 20cb0b1):
#   bash studies/prefix_cache/reclaim_sim.sh TREE NAME   # -> reclaim_sim/NAME.json
set -euo pipefail
tree=$(cd "$1" && pwd); name=$2
out=$(cd "$(dirname "$0")" && pwd)/reclaim_sim
mkdir -p "$out" /tmp/reclaim_sim
for pol in mlfq fcfs; do
  for rate in 4 6 8; do
    extra=(); [ "$pol" = mlfq ] && extra=(--sched-opt 'mlfq={"cold_start_recompute": true}')
    (cd "$tree" && PYTHONPATH="$tree" python -m bench simulate --dataset sharegpt -n 1000 \
      --seed 0 --rate "$rate" --cost-model opt-13b --gpu a100-40gb --policy "$pol" \
      --sched-opt 'swap_mode="recompute"' "${extra[@]}" \
      --out "/tmp/reclaim_sim/${name}_${pol}_$rate.json" > /dev/null) &
  done
  wait
done
python - "$name" "$out/$name.json" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
rows = []
for pol in ("mlfq", "fcfs"):
    for rate in (4, 6, 8):
        s = json.load(open(f"/tmp/reclaim_sim/{name}_{pol}_{rate}.json"))["summary"]
        rows.append({"policy": pol, "rate": rate, "completed": s["num_completed"],
                     "nl_mean": s["normalized_latency"]["mean"], "e2e_mean": s["e2e"]["mean"],
                     "ttft_p99": s["ttft"]["p99"], "preemptions": s["num_preemptions"],
                     "duration": s["duration"]})
json.dump(rows, open(path, "w"), indent=1)
for r in rows:
    print(r)
PY
