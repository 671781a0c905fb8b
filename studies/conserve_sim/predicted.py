"""Co-serving's offline admission by predicted length, where memory binds.

    python -m studies.conserve_sim.predicted     # -> predicted.json, ~25 min

`studies.conserve_sim.run` measures co-serving where the KV cache never runs
out (Llama-2-7B on an A100-80GB: no preemption in any run), so only the
compute budget is compared.  Here memory binds: OPT-13B on one A100-40GB
(the analytic cost model; the EconoServe study's setting), a host tier for
checkpoints, online ShareGPT requests with Gamma cv 2 arrivals and a
backlog of offline ones from t = 0.  Requests come from the ShareGPT test
split with the trained predictor's own predictions
(`studies/econoserve_sim/test_predictions.jsonl`); each asks for as many
tokens as fit and ends at its true length, so no policy reads the length
from `max_tokens`.

Systems: `online-only` (the online stream alone, FCFS), `conserve`
(`offline_admission: free`, the default) and `conserve-predicted`
(`offline_admission: predicted`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.__main__ import build_parser
from bench.cli_sim import sim_setup
from bench.arrivals import ArrivalSpec, arrival_times
from bench.metrics import summarize
from bench.simulator import SimOptions, simulate
from bench.workload import RequestSpec
from studies.conserve_sim.run import class_figures
from studies.econoserve_sim.run import GPU, HOST, PADDING, load_pairs

OUT = Path(__file__).resolve().parent
N_ONLINE = 500
# Enough that the backlog outlasts the online stream at every rate.
N_OFFLINE = 2000
RATES = [1.0, 2.0]
SEED = 0
SYSTEMS: dict[str, list[str]] = {
    "online-only": [],
    "conserve": [],
    "conserve-predicted": ["--sched-opt", 'conserve={"offline_admission": "predicted"}'],
}


def workload(rate: float, max_model_len: int) -> list[RequestSpec]:
    pairs = load_pairs(max_model_len)
    rng = np.random.default_rng(SEED)
    on = rng.choice(len(pairs), size=N_ONLINE)
    off = rng.choice(len(pairs), size=N_OFFLINE)
    times = arrival_times(ArrivalSpec(rate=rate, process="gamma", cv=2.0), N_ONLINE, rng)
    out: list[RequestSpec] = []
    for k, (i, t, cls) in enumerate([*((i, t, "online") for i, t in zip(on, times)),
                                     *((i, 0.0, "offline") for i in off)]):
        p = pairs[int(i)]
        out.append(RequestSpec(
            request_id=f"{cls}{k}", job_class=cls, arrival_time=float(t),
            prompt_tokens=p["prompt_tokens"], output_tokens=p["response_len"],
            max_tokens=max_model_len - p["prompt_tokens"],
            predicted_output_tokens=p["predicted_len"]))
    out.sort(key=lambda r: r.arrival_time)
    return out


def point(system: str, rate: float) -> dict[str, Any]:
    alone = system == "online-only"
    args = ["--cost-model", "opt-13b", "--gpu", GPU, "--policy", "fcfs" if alone else "conserve",
            "--sched-opt", HOST, "--overlap-swap", *SYSTEMS[system]]
    a = build_parser().parse_args(["simulate", *args])
    cost, sc = sim_setup(a)
    reqs = [r for r in workload(rate, sc.max_model_len) if not alone or r.job_class == "online"]
    t0 = time.perf_counter()
    out = simulate(reqs, sc, cost, SimOptions(overlap_swap=True, padding_ratio=PADDING))
    t_end = max(r.arrival_time for r in reqs if r.job_class == "online")
    st = out.stats.as_dict()
    res: dict[str, Any] = {"system": system, "rate": rate, "args": args, "span_s": t_end,
                           "num_blocks": sc.num_blocks, **class_figures(out.records, t_end)}
    online = [r for r in out.records if r.job_class == "online"]
    res["online"]["jct_mean"] = summarize(online).e2e.mean
    res["stats"] = {k: st[k] for k in ("num_preemptions", "swap_blocks", "checkpoint_blocks",
                                       "checkpoint_discards", "tokens_discarded",
                                       "tokens_dropped", "mean_kv_utilization")}
    res["wall_s"] = time.perf_counter() - t0
    print(f"  {system:24s} rate {rate:g}: online {json.dumps(res['online'])} "
          f"offline {json.dumps(res.get('offline'))} {json.dumps(res['stats'])}", flush=True)
    return res


def main() -> None:
    points = [point(s, r) for r in RATES for s in SYSTEMS]
    (OUT / "predicted.json").write_text(json.dumps(
        {"n_online": N_ONLINE, "n_offline": N_OFFLINE, "gpu": GPU, "cost_model": "opt-13b",
         "padding": PADDING, "points": points}, indent=1))
    print(f"wrote {OUT / 'predicted.json'}")


if __name__ == "__main__":
    main()
