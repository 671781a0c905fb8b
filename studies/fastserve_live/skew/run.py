"""How much can MLFQ gain over FCFS on the live configuration?  A simulated
study over the workload's length cap and the starvation threshold α, with
the clairvoyant orders of bench/oracle.py as the bound of any order.

    python -m studies.fastserve_live.skew.run          # ~4 min, writes skew.json, skew.md, skew.png

The first live comparison (studies/fastserve_live/fastserve_live.sh with its default
MAX_TOTAL) keeps ShareGPT conversations whose prompt + answer fit 320
tokens, so that a run takes minutes on this CPU.  That filter also shapes
the answer lengths: most of what is left is
100-300 tokens and the tail is cut off.  MLFQ, which knows nothing of a
job's length, approximates least-attained-service order; that order beats
FCFS on mean latency only when a job that has run long is likely to run
much longer (a decreasing hazard, as in the uncut ShareGPT tail).  This
study replays the live server's configuration (studies/configs/*.yaml, its
cost table measured in place) in the simulator, which agrees with the live
server within 3-14 % (studies/validation, trace/summary.txt), for
several caps and α, each at 1x, 1.5x and 2x FCFS's saturated throughput;
a ratio is of mean normalized latencies averaged over three workload seeds.

Each point is exactly `python -m bench simulate <args>` (stored as `cmd`).
For each cap it also records the mean residual answer length E[X - a | X > a]
at the quartiles a of the answer lengths: growing with a means a decreasing
hazard (what least-attained-service order exploits), shrinking means an
increasing one (where FCFS order is already close to the best blind order).
"""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path
from typing import Any

from bench.__main__ import _PoolCache, _workload_spec, build_parser
from bench.cli_sim import sim_setup
from bench.metrics import summarize
from bench.simulator import SimOptions, measure_capacity, simulate

OUT = Path(__file__).resolve().parent
TABLE = "studies/validation/cost_table_live.json"
N = 100
# Three workloads (arrival and length draws) per point: 100 requests is
# what a live run holds, and one draw of them is noisy.
SEEDS = [0, 1, 2]
CAPS = [320, 512, 640, 1024]
LOADS = [1.0, 1.5, 2.0]
# "default": per job, half the TTFT SLO before the first token and the
# normalized-latency budget of a max_model_len job after it (594 s here);
# 2.5 s for every job was the default before (MLFQPolicy.alpha_for).
ALPHAS: dict[str, float | None] = {"default": None, "2.5 s for all": 2.5, "10 s": 10.0,
                                   "30 s": 30.0, "inf": 1e9}
# Columns: MLFQ at each α, then the clairvoyant orders of bench/oracle.py
# (they know every answer's length: a bound on what any order can gain).
COLUMNS: dict[str, tuple[str, float | None]] = {
    **{f"MLFQ α {k}": ("mlfq", v) for k, v in ALPHAS.items()},
    "oracle SRPT": ("oracle-srpt", None), "oracle SJF": ("oracle-sjf", None)}
# studies/configs/{fcfs,mlfq}.yaml in 16-token blocks.
LIVE = ["--cost-model", TABLE, "--num-blocks", "128", "--block-size", "16",
        "--max-batch-size", "32", "--max-batch-tokens", "512", "--max-model-len", "1024",
        "--sched-opt", 'swap_mode="proactive"', "--sched-opt", "host_kv_blocks=4096",
        "--overlap-swap"]

_pools = _PoolCache(build_parser().parse_args(["simulate"]).tokenizer, need_text=False)


def args_for(cap: int, rate: float, policy: str, alpha: float | None, seed: int = 0) -> list[str]:
    a = ["--dataset", "sharegpt", "-n", str(N), "--seed", str(seed), "--max-total-len", str(cap),
         "--rate", f"{rate:.4g}", "--policy", policy, *LIVE]
    if alpha is not None:
        a += ["--sched-opt", f"mlfq={json.dumps({'starvation_s': alpha})}"]
    return a


def point(args: list[str]) -> dict[str, Any]:
    a = build_parser().parse_args(["simulate", *args])
    wl = _pools.build(_workload_spec(a))
    cost, sc = sim_setup(a)
    out = simulate(wl.requests, sc, cost, SimOptions(overlap_swap=a.overlap_swap))
    s = summarize(out.records)
    return {"cmd": "python -m bench simulate " + shlex.join(args),
            "nl_mean": s.normalized_latency.mean, "nl_p95": s.normalized_latency.p95,
            "ttft_p99": s.ttft.p99, "throughput": s.request_throughput,
            "preemptions": out.stats.num_preemptions}


def shape(cap: int) -> dict[str, Any]:
    outs: list[int] = []
    for seed in SEEDS:
        a = build_parser().parse_args(["simulate", *args_for(cap, 1.0, "fcfs", None, seed)])
        outs += [r.output_tokens for r in _pools.build(_workload_spec(a)).requests]
    outs.sort()
    q = statistics.quantiles(outs, n=4)
    mrl = {f"q{25 * (i + 1)}": statistics.mean(x - a for x in outs if x > a)
           for i, a in enumerate(q)}
    return {"answer_mean": statistics.mean(outs), "answer_quartiles": q,
            "answer_cv": statistics.pstdev(outs) / statistics.mean(outs),
            "mean_residual": {"q0": statistics.mean(outs), **mrl}}


def capacity(cap: int) -> float:
    """FCFS's saturated throughput, averaged over the seeds' workloads."""
    caps = []
    for seed in SEEDS:
        a = build_parser().parse_args(["simulate", *args_for(cap, 1.0, "fcfs", None, seed)])
        wl = _pools.build(_workload_spec(a).with_rate(float("inf")))
        cost, sc = sim_setup(a)
        caps.append(measure_capacity(wl.requests, sc, cost, SimOptions(overlap_swap=True)))
    return statistics.mean(caps)


def averaged(cap: int, rate: float, policy: str, alpha: float | None) -> dict[str, Any]:
    pts = [point(args_for(cap, rate, policy, alpha, seed)) for seed in SEEDS]
    return {"nl_mean": statistics.mean(p["nl_mean"] for p in pts), "seeds": pts}


def main() -> None:
    rows: list[dict[str, Any]] = []
    for cap in CAPS:
        cap_rate = capacity(cap)
        sh = shape(cap)
        print(f"cap {cap}: FCFS saturates at {cap_rate:.3f} req/s; answers {sh}", flush=True)
        for load in LOADS:
            rate = load * cap_rate
            fcfs = averaged(cap, rate, "fcfs", None)
            for label, (policy, alpha) in COLUMNS.items():
                mlfq = averaged(cap, rate, policy, alpha)
                rows.append({"cap": cap, "capacity": cap_rate, "load": load, "rate": rate,
                             "alpha": label, "shape": sh, "fcfs": fcfs, "mlfq": mlfq,
                             "ratio": mlfq["nl_mean"] / fcfs["nl_mean"]})
                print(f"  load {load:g} ({rate:.3f}/s) {label}: FCFS {fcfs['nl_mean']:.3f} "
                      f"it {mlfq['nl_mean']:.3f} ratio {rows[-1]['ratio']:.2f}", flush=True)
    (OUT / "skew.json").write_text(json.dumps({"n": N, "seeds": SEEDS, "table": TABLE,
                                               "rows": rows}, indent=1))
    write_markdown(rows)
    plot(rows)


def write_markdown(rows: list[dict[str, Any]]) -> None:
    lines = ["| cap (tokens) | FCFS saturation (req/s) | answer quartiles | mean residual answer at "
             "q0 / q25 / q50 / q75 | load | " + " | ".join(f"{k} / FCFS" for k in COLUMNS)
             + " |", "|---" * (5 + len(COLUMNS)) + "|"]
    for cap in CAPS:
        for load in LOADS:
            sel = [r for r in rows if r["cap"] == cap and r["load"] == load]
            sh = sel[0]["shape"]
            mrl = " / ".join(f"{v:.0f}" for v in sh["mean_residual"].values())
            qs = " / ".join(f"{v:.0f}" for v in sh["answer_quartiles"])
            lines.append(f"| {cap} | {sel[0]['capacity']:.3f} | {qs} | {mrl} | {load:g} | "
                         + " | ".join(f"{r['ratio']:.2f}" for r in sel) + " |")
    (OUT / "skew.md").write_text("\n".join(lines) + "\n")


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LOADS), figsize=(4 * len(LOADS), 3.4), sharey=True)
    for ax, load in zip(axes, LOADS):
        for label in COLUMNS:
            sel = [r for r in rows if r["load"] == load and r["alpha"] == label]
            ax.plot([r["cap"] for r in sel], [r["ratio"] for r in sel], marker="o",
                    ls=":" if label.startswith("oracle") else "-", label=label)
        ax.axhline(0.5, color="grey", ls="--", lw=1)
        ax.set_title(f"rate = {load:g} x FCFS saturation")
        ax.set_xlabel("ShareGPT prompt + answer cap (tokens)")
    axes[0].set_ylabel("MLFQ / FCFS mean normalized latency")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "skew.png", dpi=110)
    print(f"wrote {OUT / 'skew.png'}")


if __name__ == "__main__":
    main()
