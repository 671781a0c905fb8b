"""ConServe co-serving at paper scale in the simulator (ConServe §6.2, Figs. 5-6 style).

    python -m studies.conserve_sim.run         # ~10 min: conserve.json, conserve.png
    python -m studies.conserve_sim.run plot    # conserve.png from conserve.json

Llama-2-7B on one A100-80GB (the analytic cost model), ShareGPT.  Online:
3,000 requests, Gamma arrivals with cv 2 (bursty) at each rate.  Offline: a
backlog of 16,000 ShareGPT requests present from t = 0, more than any
system finishes while the online stream lasts.  Systems (each point is
exactly one `python -m bench simulate …`, stored with it as `cmd`):

- `online-only`: the online stream alone, FCFS (vLLM);
- `offline-only`: the backlog alone, FCFS: the offline ceiling;
- `vllm++`: both, FCFS with the offline requests at priority 1 (an online
  request is admitted first, but running offline work keeps its place in
  the batch and is only preempted when KV runs out);
- `conserve`: both, `policy: conserve` with its default objectives (TTFT
  10x and TPOT 3x the batch-1 decode iteration);
- `conserve-tpot25`: the same with TTFT and TPOT objectives of 25 ms.

Offline throughput is counted over the online stream's span (t = 0 to the
last online arrival), or until the backlog runs out if that comes first:
offline tokens generated in that window over its length, so that the tail
where the backlog runs alone does not count.  It is also counted over the
span's steady part, from STEADY_FROM of it on: in the warm-up the online
jobs in flight build up to their steady number, and a system that serves
them slower (vllm++) builds up more of them, for longer, so that online
work it owes is counted as offline throughput it made.  Once steady, every
system serves the online stream's rate (the online figures'
`steady_tokens_per_s`, the same window), and the offline figures compare
the capacity left beside it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from bench.__main__ import _PoolCache, _workload_spec, build_parser
from bench.cli_sim import sim_setup
from bench.metrics import summarize, tokens_per_s_while
from bench.simulator import SimOptions, simulate

OUT = Path(__file__).resolve().parent
RATES = [4.0, 8.0, 12.0]
BASE = ["--cost-model", "llama-2-7b", "--gpu", "a100-80gb", "--dataset", "sharegpt",
        "--seed", "0", "--cv", "2"]
N_ONLINE = "3000"
OFFLINE = ["--offline-num-requests", "16000", "--offline-dataset", "sharegpt"]
STEADY_FROM = 0.2  # of the online stream's span
SYSTEMS: dict[str, list[str]] = {
    "online-only": ["--policy", "fcfs"],
    "offline-only": ["--policy", "fcfs", *OFFLINE],
    "vllm++": ["--policy", "fcfs", *OFFLINE, "--offline-priority", "1"],
    "conserve": ["--policy", "conserve", *OFFLINE],
    "conserve-tpot25": ["--policy", "conserve", *OFFLINE, "--sched-opt",
                        'conserve={"ttft_slo_s": 0.025, "tpot_slo_s": 0.025}'],
}

_pools = _PoolCache(build_parser().parse_args(["simulate"]).tokenizer, need_text=False)


def point(system: str, rate: float) -> dict[str, Any]:
    n_online = "0" if system == "offline-only" else N_ONLINE
    args = [*BASE, "--rate", f"{rate:g}", "-n", n_online, *SYSTEMS[system]]
    a = build_parser().parse_args(["simulate", *args])
    wl = _pools.build(_workload_spec(a))
    cost, sc = sim_setup(a)
    out = simulate(wl.requests, sc, cost, SimOptions(overlap_swap=a.overlap_swap))
    # The online stream's span; offline-only borrows the same rate's span.
    span_wl = _pools.build(_workload_spec(build_parser().parse_args(
        ["simulate", *BASE, "--rate", f"{rate:g}", "-n", N_ONLINE])))
    t_end = max(r.arrival_time for r in span_wl.requests if r.job_class == "online")
    res: dict[str, Any] = {"cmd": "python -m bench simulate " + shlex.join(args),
                           "system": system, "rate": rate, "span_s": t_end}
    res.update(class_figures(out.records, t_end))
    res["iterations"] = out.stats.iterations
    print(f"  {system:16s} rate {rate:g}: " + json.dumps(
        {k: v for k, v in res.items() if k in ("online", "offline")}), flush=True)
    return res


def class_figures(records: list[Any], t_end: float) -> dict[str, Any]:
    """Online latency percentiles and offline tokens/s until `t_end`."""
    res: dict[str, Any] = {}
    start = STEADY_FROM * t_end
    online = [r for r in records if r.job_class == "online"]
    if online:
        s = summarize(online)
        res["online"] = {"completed": s.num_completed, "ttft_p50": s.ttft.median,
                         "ttft_p99": s.ttft.p99, "tpot_p50": s.tpot.median,
                         "tpot_p99": s.tpot.p99,
                         "steady_tokens_per_s": tokens_per_s_while(
                             online, "online", t_end, start)[0]}
    offline = [r for r in records if r.job_class == "offline"]
    if offline:
        rate_s, window = tokens_per_s_while(offline, "offline", t_end)
        steady, steady_window = tokens_per_s_while(offline, "offline", t_end, start)
        res["offline"] = {"tokens_in_window": round(rate_s * window), "window_s": window,
                          "tokens_per_s": rate_s, "steady_from_s": start,
                          "steady_window_s": steady_window, "steady_tokens_per_s": steady,
                          "preemptions": sum(r.num_preemptions or 0 for r in offline)}
    return res


def ratios(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(p["system"], p["rate"]): p for p in points}
    rows = []
    for rate in RATES:
        base_on = by[("online-only", rate)]["online"]
        base_off = by[("vllm++", rate)]["offline"]["tokens_per_s"]
        base_steady = by[("vllm++", rate)]["offline"]["steady_tokens_per_s"]
        for system in ("vllm++", "conserve", "conserve-tpot25"):
            p = by[(system, rate)]
            rows.append({
                "system": system, "rate": rate,
                "ttft_p99_vs_online_only": p["online"]["ttft_p99"] / base_on["ttft_p99"],
                "tpot_p99_vs_online_only": p["online"]["tpot_p99"] / base_on["tpot_p99"],
                "offline_vs_vllmpp": p["offline"]["tokens_per_s"] / base_off,
                "offline_vs_vllmpp_steady": p["offline"]["steady_tokens_per_s"] / base_steady,
            })
    return rows


def plot(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = ["online-only", "vllm++", "conserve", "conserve-tpot25", "offline-only"]
    colors = dict(zip(systems, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:gray"]))
    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    width = 0.16
    for i, system in enumerate(systems):
        ps = {p["rate"]: p for p in points if p["system"] == system}
        xs = [j + (i - 2) * width for j in range(len(RATES))]
        if "online" in ps[RATES[0]]:
            for ax, key in ((axes[0], "ttft_p99"), (axes[1], "tpot_p99")):
                ax.bar(xs, [ps[r]["online"][key] * 1e3 for r in RATES], width, label=system,
                       color=colors[system])
        if "offline" in ps[RATES[0]]:
            for ax, key in ((axes[2], "tokens_per_s"), (axes[3], "steady_tokens_per_s")):
                ax.bar(xs, [ps[r]["offline"][key] for r in RATES], width, label=system,
                       color=colors[system])
    for ax, title in zip(axes, ["online P99 TTFT (ms)", "online P99 TPOT (ms)",
                                "offline tokens/s, the online stream's span",
                                f"offline tokens/s, from {STEADY_FROM:.0%} of the span on"]):
        ax.set_xticks(range(len(RATES)), [f"{r:g} req/s" for r in RATES])
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.suptitle("Co-serving, Llama-2-7B / A100-80GB (simulated), 3,000 online ShareGPT requests, Gamma cv 2 "
                 "+ 16,000 offline requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    import sys

    if sys.argv[1:] == ["plot"]:  # redraw from the saved points
        plot(json.loads((OUT / "conserve.json").read_text())["points"], OUT / "conserve.png")
        return
    points = [point(system, rate) for rate in RATES for system in SYSTEMS]
    data = {"points": points, "ratios": ratios(points)}
    (OUT / "conserve.json").write_text(json.dumps(data, indent=1))
    plot(points, OUT / "conserve.png")
    for row in data["ratios"]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
