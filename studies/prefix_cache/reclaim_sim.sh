#!/usr/bin/env bash
# The prefix cache giving a preempted job's blocks back (studies/prefix_cache/
# README.md, "Looked up again when a job starts" and "Swap-ins that copy only
# what left the device"): the FastServe setting of ../fastserve_sim (OPT-13B on
# an A100-40GB, simulated) at 4, 6 and 8 req/s, run by the tree TREE (this
# checkout, or a worktree of the commit before a change, e.g.
#   git worktree add /tmp/before 20cb0b1):
#   bash studies/prefix_cache/reclaim_sim.sh TREE NAME [SET]   # -> reclaim_sim/NAME.json
# SET recompute (default): MLFQ and FCFS with `swap_mode: recompute`;
# SET swap: MLFQ proactive and reactive, FCFS reactive, a host tier that never fills.
set -euo pipefail
tree=$(cd "$1" && pwd); name=$2; set=${3:-recompute}
out=$(cd "$(dirname "$0")" && pwd)/reclaim_sim
mkdir -p "$out" /tmp/reclaim_sim
host=(--sched-opt host_kv_blocks=100000)
cold=(--sched-opt 'mlfq={"cold_start_recompute": true}')
case $set in
  recompute) systems="mlfq-recompute fcfs-recompute" ;;
  swap) systems="mlfq-proactive mlfq-reactive fcfs-reactive" ;;
esac
for sys in $systems; do
  case $sys in
    mlfq-recompute) a=(--policy mlfq --sched-opt 'swap_mode="recompute"' "${cold[@]}") ;;
    fcfs-recompute) a=(--policy fcfs --sched-opt 'swap_mode="recompute"') ;;
    mlfq-proactive) a=(--policy mlfq --sched-opt 'swap_mode="proactive"' "${host[@]}" --overlap-swap "${cold[@]}") ;;
    mlfq-reactive) a=(--policy mlfq --sched-opt 'swap_mode="reactive"' "${host[@]}" "${cold[@]}") ;;
    fcfs-reactive) a=(--policy fcfs --sched-opt 'swap_mode="reactive"' "${host[@]}") ;;
  esac
  for rate in 4 6 8; do
    (cd "$tree" && PYTHONPATH="$tree" python -m bench simulate --dataset sharegpt -n 1000 \
      --seed 0 --rate "$rate" --cost-model opt-13b --gpu a100-40gb "${a[@]}" \
      --out "/tmp/reclaim_sim/${name}_${sys}_$rate.json" > /dev/null) &
  done
  wait
done
python - "$name" "$out/$name.json" $systems <<'PY'
import json, sys
name, path, systems = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = []
for system in systems:
    for rate in (4, 6, 8):
        s = json.load(open(f"/tmp/reclaim_sim/{name}_{system}_{rate}.json"))["summary"]
        rows.append({"system": system, "rate": rate, "completed": s["num_completed"],
                     "nl_mean": s["normalized_latency"]["mean"], "e2e_mean": s["e2e"]["mean"],
                     "ttft_p99": s["ttft"]["p99"], "preemptions": s["num_preemptions"],
                     "swap_gb": s["swap_bytes"] / 1e9,
                     "swap_share": s["breakdown"]["swap_share"], "duration": s["duration"]})
json.dump(rows, open(path, "w"), indent=1)
for r in rows:
    print(r)
PY
