"""How preempted offline work resumes (ConServe Fig. 4) and what each part
of co-serving adds (Fig. 8), in the simulator at paper scale.

    python -m studies.conserve_sim.ablation        # ablation.json, ablation.png
    python -m studies.conserve_sim.ablation plot   # ablation.png from ablation.json

Llama-2-7B on one A100-40GB (the analytic cost model; 2,873 KV blocks of
16 tokens), as §6.4.1: 600 online requests of 1,024 prompt and 128 output
tokens, Gamma arrivals with cv 1 at 2 req/s; offline, a backlog of 500
requests of 1,024 prompt and 1,024 output tokens present from t = 0, so
that offline work fills the KV cache and online arrivals must take memory
from it.
Systems (each point is exactly one `python -m bench simulate …`, stored
with it as `cmd`):

- `online-only`: the online stream alone, FCFS;
- `vllm++`: FCFS with the offline requests at priority 1, preempted
  requests swapped out and in on the critical path;
- `conserve/recompute`: co-serving; a preempted offline job drops its KV
  and recomputes it (Fig. 4a);
- `conserve/swap`: co-serving; a preempted offline job is swapped out at
  preemption, and back in before it runs, both on the critical path
  (Fig. 4b);
- `conserve/checkpoint`: co-serving with incremental checkpointing; a
  preempted job is discarded to its checkpoint, and its swap-in runs on
  the critical path (Fig. 4c);
- `conserve/checkpoint+prefetch`: the same with swap-ins in the background
  while others compute (Fig. 4d; the default when a host tier is set).

Offline throughput is counted from t = 0 to the last online arrival, as in
`run.py`.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from bench.__main__ import _PoolCache, _workload_spec, build_parser
from bench.cli_sim import sim_setup
from bench.simulator import SimOptions, simulate
from studies.conserve_sim.run import class_figures

OUT = Path(__file__).resolve().parent
BASE = ["--cost-model", "llama-2-7b", "--gpu", "a100-40gb", "--seed", "0",
        "--dataset", "fixed", "--input-len", "1024", "--output-len", "128",
        "-n", "600", "--rate", "2", "--cv", "1",
        "--max-prompt-len", "4000", "--max-total-len", "4096",
        "--sched-opt", "max_model_len=4096"]
OFFLINE = ["--offline-num-requests", "500", "--offline-dataset", "fixed",
           "--offline-input-len", "1024", "--offline-output-len", "1024"]
HOST = ["--sched-opt", "host_kv_blocks=40000"]
NO_CKPT = ["--sched-opt", 'conserve={"checkpoint": false}']
SYSTEMS: dict[str, list[str]] = {
    "online-only": ["--policy", "fcfs"],
    "vllm++": ["--policy", "fcfs", *OFFLINE, "--offline-priority", "1", *HOST,
               "--sched-opt", 'swap_mode="reactive"'],
    "conserve/recompute": ["--policy", "conserve", *OFFLINE, *NO_CKPT],
    "conserve/swap": ["--policy", "conserve", *OFFLINE, *HOST, *NO_CKPT,
                      "--sched-opt", 'swap_mode="reactive"'],
    "conserve/checkpoint": ["--policy", "conserve", *OFFLINE, *HOST],
    "conserve/checkpoint+prefetch": ["--policy", "conserve", *OFFLINE, *HOST,
                                     "--overlap-swap"],
}

_pools = _PoolCache(build_parser().parse_args(["simulate"]).tokenizer, need_text=False)


def point(system: str) -> dict[str, Any]:
    args = [*BASE, *SYSTEMS[system]]
    a = build_parser().parse_args(["simulate", *args])
    wl = _pools.build(_workload_spec(a))
    cost, sc = sim_setup(a)
    out = simulate(wl.requests, sc, cost, SimOptions(overlap_swap=a.overlap_swap))
    t_end = max(r.arrival_time for r in wl.requests if r.job_class == "online")
    res: dict[str, Any] = {"cmd": "python -m bench simulate " + shlex.join(args),
                           "system": system, "span_s": t_end}
    res.update(class_figures(out.records, t_end))
    st = out.stats.as_dict()
    res["stats"] = {k: st[k] for k in (
        "num_preemptions", "busy_time", "exposed_swap_time", "swap_in_blocks",
        "swap_out_blocks", "checkpoint_blocks", "checkpoint_lane_busy",
        "checkpoint_discards", "tokens_discarded", "tokens_dropped", "recompute_fallbacks",
        "cut_passes")}
    print(f"  {system:30s} " + json.dumps({k: res.get(k) for k in ("online", "offline")}),
          flush=True)
    return res


def plot(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p["system"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = (("online P99 TTFT (ms)", [p["online"]["ttft_p99"] * 1e3 for p in points]),
              ("online P99 TPOT (ms)", [p["online"]["tpot_p99"] * 1e3 for p in points]),
              ("offline tokens/s during the online stream",
               [p.get("offline", {}).get("tokens_per_s", 0.0) for p in points]))
    for ax, (title, ys) in zip(axes, series):
        ax.bar(range(len(names)), ys, color="tab:green")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
    axes[0].set_yscale("log")
    fig.suptitle("Resume strategies and co-serving ablation, Llama-2-7B / A100-40GB "
                 "(simulated): online 1024/128 at 2 req/s cv 1 + offline 1024/1024 backlog")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if sys.argv[1:] == ["plot"]:
        plot(json.loads((OUT / "ablation.json").read_text())["points"], OUT / "ablation.png")
        return
    points = [point(system) for system in SYSTEMS]
    (OUT / "ablation.json").write_text(json.dumps({"points": points}, indent=1))
    plot(points, OUT / "ablation.png")


if __name__ == "__main__":
    main()
