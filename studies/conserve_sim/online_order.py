"""Co-serving with the online class ordered FCFS or by skip-join MLFQ
(`conserve.online_order`), at online loads where online requests compete
for the iteration among themselves.

    python -m studies.conserve_sim.online_order        # ~8 min: online_order.json

Llama-2-7B on one A100-80GB (the analytic cost model), ShareGPT: 1,000
online requests, Gamma arrivals with cv 2 at 20 and 28 req/s, beside a
backlog of 2,000 offline ShareGPT requests from t = 0; `policy: conserve`
with its default objectives.  Offline throughput is counted until the last
online arrival, as in `run.py`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from bench.__main__ import _PoolCache, _workload_spec, build_parser
from bench.cli_sim import sim_setup
from bench.metrics import summarize
from bench.simulator import SimOptions, simulate
from studies.conserve_sim.run import class_figures

OUT = Path(__file__).resolve().parent
RATES = [20.0, 28.0]
BASE = ["--cost-model", "llama-2-7b", "--gpu", "a100-80gb", "--dataset", "sharegpt",
        "--seed", "0", "--cv", "2", "-n", "1000", "--policy", "conserve",
        "--offline-num-requests", "2000", "--offline-dataset", "sharegpt"]

_pools = _PoolCache(build_parser().parse_args(["simulate"]).tokenizer, need_text=False)


def point(order: str, rate: float) -> dict[str, Any]:
    args = [*BASE, "--rate", f"{rate:g}", "--sched-opt",
            f'conserve={{"online_order": "{order}"}}']
    a = build_parser().parse_args(["simulate", *args])
    wl = _pools.build(_workload_spec(a))
    cost, sc = sim_setup(a)
    out = simulate(wl.requests, sc, cost, SimOptions())
    t_end = max(r.arrival_time for r in wl.requests if r.job_class == "online")
    res: dict[str, Any] = {"cmd": "python -m bench simulate " + shlex.join(args),
                           "online_order": order, "rate": rate, "span_s": t_end}
    res.update(class_figures(out.records, t_end))
    s = summarize([r for r in out.records if r.job_class == "online"])
    res["online"]["normalized_latency_mean"] = s.normalized_latency.mean
    print(json.dumps({k: res[k] for k in ("online_order", "rate", "online", "offline")}),
          flush=True)
    return res


def main() -> None:
    points = [point(order, rate) for rate in RATES for order in ("fcfs", "mlfq")]
    (OUT / "online_order.json").write_text(json.dumps({"points": points}, indent=1))


if __name__ == "__main__":
    main()
