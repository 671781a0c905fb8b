"""EconoServe at paper scale in the simulator (studies/econoserve_sim/README.md).

OPT-13B on one A100-40GB (the analytic cost model), requests drawn from the
ShareGPT test split with the trained predictor's own predictions
(`test_predictions.jsonl`, made by `python -m studies.econoserve_sim.predictions`):
EconoServe is scheduled with the predictor's real errors, not an oracle's.

    python -m studies.econoserve_sim.run compare            # systems x rates -> compare.json
    python -m studies.econoserve_sim.run compare --cv 3     # bursty arrivals -> compare_cv3.json
    python -m studies.econoserve_sim.run padding            # Fig. 4: padding sweet spot -> padding.json
    python -m studies.econoserve_sim.run ablation           # Fig. 11-style -> ablation.json
    python -m studies.econoserve_sim.run enst               # mlfq.enst -> enst.json
    python -m studies.econoserve_sim.run refine             # overrun_extension -> refine.json
    python -m studies.econoserve_sim.run plots
    python -m studies.econoserve_sim.run table --file compare.json   # markdown, with loads

Each request's JCT SLO is EconoServe's (§4): 2 x (its prefill time + its
true response length x one decode iteration of a full batch), from the
same cost model.  A rate counts toward a maximum only where the run was
stable (completed >= 95 % of the rate the arrivals realised, the rule of
`bench.sweep.is_stable`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.__main__ import build_parser
from bench.cli_sim import sim_setup
from bench.arrivals import ArrivalSpec, arrival_times
from bench.metrics import summarize
from bench.oracle import register as register_oracles
from bench.simulator import CostEstimatorAdapter, SimOptions, measure_capacity, simulate
from bench.sweep import STABLE_SHARE
from bench.workload import RequestSpec

OUT = Path(__file__).resolve().parent
PREDICTIONS = OUT / "test_predictions.jsonl"
N = 3000
SEED = 0
GPU = "a100-40gb"
HOST = "host_kv_blocks=100000"
SLO_SCALE = 2.0
# The predictor's padding on its predictions (EconoServe §2.3); `padding`
# measures the sweet spot for this predictor.
PADDING = 0.15

SYSTEMS: dict[str, list[str]] = {
    "fcfs": ["--policy", "fcfs"],
    "mlfq": ["--policy", "mlfq", "--sched-opt", 'swap_mode="proactive"', "--sched-opt", HOST,
             "--overlap-swap"],
    # FastServe's skip-join by predicted whole work instead of the prefill.
    "mlfq-predicted": ["--policy", "mlfq", "--sched-opt", 'swap_mode="proactive"',
                       "--sched-opt", HOST, "--overlap-swap",
                       "--sched-opt", 'mlfq={"skip_join": "predicted"}'],
    "oracle-sjf": ["--policy", "oracle-sjf", "--sched-opt", 'swap_mode="proactive"',
                   "--sched-opt", HOST, "--overlap-swap"],
    "econoserve": ["--policy", "econoserve"],
    # The same policy handed the true lengths: what a perfect predictor buys.
    "econoserve-oracle": ["--policy", "econoserve"],
}
# ENST with predicted remaining service (`mlfq.enst`), alone and with the
# predicted skip-join.
_MLFQ = ["--policy", "mlfq", "--sched-opt", 'swap_mode="proactive"', "--sched-opt", HOST,
         "--overlap-swap"]
ENST: dict[str, list[str]] = {
    "mlfq": _MLFQ,
    "mlfq-enst": [*_MLFQ, "--sched-opt", 'mlfq={"enst": "predicted"}'],
    "mlfq-predicted": [*_MLFQ, "--sched-opt", 'mlfq={"skip_join": "predicted"}'],
    "mlfq-predicted-enst": [*_MLFQ, "--sched-opt",
                            'mlfq={"skip_join": "predicted", "enst": "predicted"}'],
}
# An overrun extended by the refined remaining length (`overrun_extension`).
REFINE: dict[str, list[str]] = {
    "econoserve": ["--policy", "econoserve"],
    "econoserve-refined": ["--policy", "econoserve", "--sched-opt",
                           'econoserve={"overrun_extension": "refined"}'],
    "econoserve-refined-q0.8": ["--policy", "econoserve", "--sched-opt",
                                'econoserve={"overrun_extension": "refined", '
                                '"refine_quantile": 0.8}'],
}
# What a GT paused on an overrun does with its KV (`econoserve.pause_kv`):
# without a host tier it is dropped whatever the setting; with one
# (MLFQ's tier here), dropped or swapped to the host.
_TIER = ["--policy", "econoserve", "--sched-opt", 'swap_mode="proactive"', "--sched-opt", HOST,
         "--overlap-swap"]
PAUSE: dict[str, list[str]] = {
    "econoserve": ["--policy", "econoserve"],
    "econoserve-tier-drop": [*_TIER, "--sched-opt", 'econoserve={"pause_kv": "drop"}'],
    "econoserve-tier-swap": [*_TIER, "--sched-opt", 'econoserve={"pause_kv": "swap"}'],
}
ABLATION: dict[str, list[str]] = {
    "econoserve": ["--policy", "econoserve"],
    "w/o pipelining": ["--policy", "econoserve", "--sched-opt", 'econoserve={"pipelining": false}'],
    "w/o time-synced": ["--policy", "econoserve", "--sched-opt",
                        'econoserve={"time_synced": false}'],
    "w/o ordering": ["--policy", "econoserve", "--sched-opt", 'econoserve={"ordering": false}'],
}


def load_pairs(max_model_len: int) -> list[dict[str, int]]:
    pairs = [json.loads(line) for line in PREDICTIONS.read_text().splitlines()]
    return [p for p in pairs if p["prompt_tokens"] + p["response_len"] <= max_model_len
            and p["response_len"] >= 1]


def workload(pairs: list[dict[str, int]], rate: float, cv: float, oracle: bool,
             max_model_len: int, capped: bool = True) -> list[RequestSpec]:
    """`N` requests at `rate`.  Capped: each asks for as many tokens as fit
    (max_model_len - prompt) and ends by end-of-sequence at its true
    length, so no policy learns the length from `max_tokens`; the
    clairvoyant `oracle-sjf` reads it there, uncapped."""
    rng = np.random.default_rng(SEED)
    idx = rng.choice(len(pairs), size=N, replace=N > len(pairs))
    spec = ArrivalSpec(rate=rate, process="poisson" if cv == 1.0 else "gamma", cv=cv)
    times = arrival_times(spec, N, rng)
    out = []
    for k, (i, t) in enumerate(zip(idx, times)):
        p = pairs[int(i)]
        out.append(RequestSpec(
            request_id=f"r{k}", arrival_time=float(t), prompt_tokens=p["prompt_tokens"],
            output_tokens=p["response_len"],
            max_tokens=max_model_len - p["prompt_tokens"] if capped else None,
            predicted_output_tokens=p["response_len"] if oracle else p["predicted_len"]))
    return out


def point(system: str, args: list[str], rate: float, cv: float = 1.0,
          padding: float = PADDING) -> dict[str, Any]:
    a = build_parser().parse_args(["simulate", "--cost-model", "opt-13b", "--gpu", GPU, *args])
    cost, sc = sim_setup(a)
    oracle = system.endswith("-oracle")
    if oracle:
        padding = 0.0  # the true lengths need none
    reqs = workload(load_pairs(sc.max_model_len), rate, cv, oracle, sc.max_model_len,
                    capped=not system.startswith("oracle-"))
    t0 = time.perf_counter()
    out = simulate(reqs, sc, cost, SimOptions(overlap_swap=a.overlap_swap, padding_ratio=padding))
    wall = time.perf_counter() - t0
    est = CostEstimatorAdapter(cost)
    tg = est.decode_time(sc.max_batch_size)
    by_id = {r.request_id: r for r in reqs}
    met = 0
    for rec in out.records:
        r = by_id[rec.request_id]
        slo = SLO_SCALE * (est.prefill_time(r.prompt_tokens) + r.output_tokens * tg)
        if rec.end_time is not None and rec.end_time - rec.scheduled_time <= slo:
            met += 1
    s = summarize(out.records)
    st = out.stats.as_dict()
    # Over the rate the arrivals realised (a bursty process's 3,000 gaps
    # can span a few % more or less than 3,000 / rate).
    offered = (N - 1) / (reqs[-1].arrival_time - reqs[0].arrival_time)
    share = s.request_throughput / offered
    res = {
        "system": system, "rate": rate, "cv": cv, "padding": padding, "args": args, "n": N,
        "completed": s.num_completed, "throughput": s.request_throughput, "offered": offered,
        "completed_share": share, "stable": share >= STABLE_SHARE,
        "jct_mean": s.e2e.mean, "jct_p95": s.e2e.p95, "jct_p99": s.e2e.p99,
        "nl_mean": s.normalized_latency.mean, "nl_p95": s.normalized_latency.p95,
        "ttft_mean": s.ttft.mean, "ttft_p99": s.ttft.p99, "tpot_mean": s.tpot.mean,
        "slo_attainment": met / N, "kv_utilization": st["mean_kv_utilization"],
        "mean_batch": st["mean_batch_size"], "preemptions": st["num_preemptions"],
        "swap_blocks": st["swap_blocks"],
        "wall_s": wall,
        **{k: v for k, v in st.items() if k.startswith("econoserve_")},
    }
    print(f"  {system:>18} rate {rate:5.2f}: done/off {100 * share:5.1f}%{'' if res['stable'] else '*'} "
          f"JCT {res['jct_mean']:7.2f}s p95 {res['jct_p95']:7.2f}s SLO {100 * res['slo_attainment']:5.1f}% "
          f"KV {100 * res['kv_utilization']:4.1f}% "
          f"preempt {res['preemptions']} wall {wall:.0f}s", flush=True)
    return res


def capacity() -> float:
    """FCFS's saturated throughput (req/s) on this workload: every request
    at t = 0 (`bench.simulator.measure_capacity`); a rate's load is
    rate / capacity."""
    a = build_parser().parse_args(["simulate", "--cost-model", "opt-13b", "--gpu", GPU,
                                   *SYSTEMS["fcfs"]])
    cost, sc = sim_setup(a)
    reqs = workload(load_pairs(sc.max_model_len), 1.0, 1.0, False, sc.max_model_len)
    return measure_capacity(reqs, sc, cost)


def pad(point: dict[str, Any]) -> str:
    """The padding, where the system reads predictions."""
    return f"{point['padding']:g}" if "econoserve" in point["args"] else "-"


def table(name: str) -> None:
    """A markdown table of one result file, with each rate's load."""
    data = json.loads((OUT / name).read_text())
    cap = data.get("capacity") or capacity()
    rows = ["| system | padding | rate (load) | done/offered | mean JCT s | P95 JCT s | "
            "mean / P95 NL s/tok | JCT SLO met | KV util | preemptions |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in data["points"]:
        rows.append(
            f"| {p['system']} | {pad(p)} | {p['rate']:g} ({p['rate'] / cap:.2f}) | "
            f"{100 * p['completed_share']:.1f}%{'' if p['stable'] else ' unstable'} | "
            f"{p['jct_mean']:.2f} | {p['jct_p95']:.2f} | {p['nl_mean']:.3f} / {p['nl_p95']:.3f} | "
            f"{100 * p['slo_attainment']:.1f}% | {100 * p['kv_utilization']:.1f}% | "
            f"{p['preemptions']} |")
    print(f"FCFS capacity (saturated): {cap:.3f} req/s")
    print("\n".join(rows))
    print()
    for key in dict.fromkeys((p["system"], pad(p)) for p in data["points"]):
        mine = [p for p in data["points"] if (p["system"], pad(p)) == key]
        best = max_stable_rate(mine)
        load = "" if best is None else f" (load {best / cap:.2f})"
        print(f"- {key[0]} (padding {key[1]}): highest stable rate with >= 90% of JCT SLOs "
              f"met: {best}{load}")


def max_stable_rate(points: list[dict[str, Any]], attainment: float = 0.9) -> float | None:
    """Highest rate of the grid below which every run is stable and meets
    `attainment` of its JCT SLOs."""
    best = None
    for p in sorted(points, key=lambda p: p["rate"]):
        if not p["stable"] or p["slo_attainment"] < attainment:
            break
        best = p["rate"]
    return best


def run(systems: dict[str, list[str]], rates: list[float], cv: float, name: str,
        padding: float, paddings: list[float] | None = None, append: bool = False) -> None:
    path = OUT / name
    if append and path.exists():  # more systems into an earlier result
        data = json.loads(path.read_text())
    else:
        data = {"n": N, "gpu": GPU, "cost_model": "opt-13b", "cv": cv,
                "predictions": PREDICTIONS.name, "points": []}
    data["capacity"] = capacity()
    for system, args in systems.items():
        for rate in rates:
            for pad in paddings or [padding]:
                data["points"].append(point(system, args, rate, cv, pad))
                path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")


def plots() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for path in sorted(OUT.glob("*.json")):
        data = json.loads(path.read_text())
        if "points" not in data:  # refinement.json: estimates, not runs
            continue
        pts = data["points"]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        paddings = len({p["padding"] for p in pts}) > 1

        def label(p: dict[str, Any]) -> str:
            return f"{p['system']} pad {p['padding']:g}" if paddings else p["system"]

        for name in dict.fromkeys(label(p) for p in pts):
            mine = sorted((p for p in pts if label(p) == name), key=lambda p: p["rate"])
            xs = [p["rate"] for p in mine]
            for ax, key in zip(axes, ("jct_mean", "slo_attainment", "kv_utilization")):
                ax.plot(xs, [p[key] for p in mine], marker="o", label=name)
                for p in mine:
                    if not p["stable"]:
                        ax.plot(p["rate"], p[key], "kx", markersize=10)
        for ax, t in zip(axes, ("mean JCT (s)", "JCT SLO attainment", "KV utilization")):
            ax.set_xlabel("rate (req/s)")
            ax.set_title(t + " (x: unstable)")
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[0].legend()
        fig.tight_layout()
        out = path.with_suffix(".png")
        fig.savefig(out, dpi=110)
        print(f"wrote {out}")


def main() -> None:
    register_oracles()
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["compare", "padding", "ablation", "enst", "refine",
                                     "pause", "plots", "table"])
    ap.add_argument("--file", default="compare.json", help="for `table`")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 3.0, 3.5, 4.0, 4.5, 5.0])
    ap.add_argument("--cv", type=float, default=1.0)
    ap.add_argument("--systems", nargs="+")
    ap.add_argument("--padding", type=float, default=PADDING)
    ap.add_argument("--append", action="store_true",
                    help="add the points to the result file instead of replacing it")
    ap.add_argument("--paddings", type=float, nargs="+",
                    default=[0.0, 0.15, 0.5, 1.0, 1.5, 2.0, 3.0])
    a = ap.parse_args()
    if a.what == "plots":
        plots()
        return
    if a.what == "table":
        table(a.file)
        return
    suffix = "" if a.cv == 1.0 else f"_cv{a.cv:g}"
    if a.what == "padding":
        run({"econoserve": SYSTEMS["econoserve"]}, a.rates, a.cv, f"padding{suffix}.json",
            a.padding, a.paddings)
        return
    chosen = {"compare": SYSTEMS, "ablation": ABLATION, "enst": ENST,
              "refine": REFINE, "pause": PAUSE}[a.what]
    systems = {k: v for k, v in chosen.items() if not a.systems or k in a.systems}
    run(systems, a.rates, a.cv, f"{a.what}{suffix}.json", a.padding, append=a.append)


if __name__ == "__main__":
    main()
