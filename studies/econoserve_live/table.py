"""The live EconoServe comparison as one table: every policy and rate of a
`run.sh` output folder, live beside its replay in the simulator.

    python -m studies.econoserve_live.table studies/econoserve_live/rates_1129 \\
        [--common-cost RUN.cost.json] [--out table.json] [--plot table.png]

Per run: the rate the arrivals realised; the share of the requests sent
that finished while requests were still arriving (a run that keeps up
finishes nearly all; below 95 % its queue grew); throughput; mean / P95
normalized latency; mean JCT; P99 TTFT; preemptions; KV utilization. KV
utilization is measured the same way live and replayed: each iteration's
jobs' KV (prompt and the tokens emitted before it, in whole blocks), over
the cache, averaged over iterations; the replay is run again with its
records for that (same command as `run.sh`, `--save-records`).  Where the
server reported when each prediction landed, their median and P90.

A shared machine's speed drifts between runs (live, the decode step of the
same batch took from 56 to 99 ms within two hours), and each replay uses its
own run's cost table, so `--common-cost` also replays every run on one
table: the policies then differ in their scheduling alone.  The live rows
give each run's median decode step with 8-12 jobs, the host's speed then.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.__main__ import main as bench_main

BLOCK = 16
NUM_BLOCKS = 128
# studies/serve_lib.sh's LIVE_SIM_ARGS.
LIVE_SIM_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK),
                 "--max-batch-size", "32", "--max-batch-tokens", "512", "--max-model-len", "1024",
                 "--sched-opt", 'swap_mode="proactive"', "--sched-opt", "host_kv_blocks=4096",
                 "--overlap-swap"]


def _align(trace: list[dict[str, Any]], records: list[dict[str, Any]]) -> float:
    """What to add to a trace time to get the records' clock (the engine's
    clock is not the client's): the first iteration's end is taken as the
    first token's arrival."""
    first = min(r["token_times"][0] for r in records if r.get("token_times"))
    return first - (trace[0]["t"] + trace[0]["iteration_time"])


def _match(trace: list[dict[str, Any]], records: list[dict[str, Any]],
           shift: float) -> dict[str, dict[str, Any]]:
    """Trace job id -> record.  A replay's ids are the records'; a live
    trace names jobs by the server's ids, which the client does not keep:
    a job is matched to the record with as many tokens as the iterations it
    was in whose first token came right after its first iteration."""
    by_id = {r["request_id"]: r for r in records}
    first: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in trace:
        for j in e["jobs"]:
            first.setdefault(j, e["t"] + e["iteration_time"] + shift)
            count[j] = count.get(j, 0) + 1
    if set(first) <= set(by_id):
        return {j: by_id[j] for j in first}
    out: dict[str, dict[str, Any]] = {}
    free = sorted(first, key=first.__getitem__)
    starts = [first[j] for j in free]
    for r in sorted((r for r in records if r.get("token_times")),
                    key=lambda r: r["token_times"][0]):
        ft = r["token_times"][0]
        lo = bisect.bisect_left(starts, ft - 5.0)
        hi = bisect.bisect_right(starts, ft + 0.05)
        if lo >= hi:
            continue
        k = min(range(lo, hi), key=lambda i: (abs(count[free[i]] - r["output_tokens"]),
                                               abs(starts[i] - ft)))
        out[free[k]] = r
        del free[k], starts[k]
    return out


def kv_utilization(trace: list[dict[str, Any]], records: list[dict[str, Any]]) -> float:
    """Mean over iterations of the blocks its jobs' KV fills, over the cache."""
    shift = _align(trace, records)
    jobs = _match(trace, records, shift)
    times = {j: sorted(r.get("token_times") or []) for j, r in jobs.items()}
    shares = []
    for e in trace:
        at = e["t"] + shift  # the iteration's start, on the records' clock
        used = 0
        for j in e["jobs"]:
            r = jobs.get(j)
            if r is not None:
                ctx = r["prompt_tokens"] + bisect.bisect_left(times[j], at)
                used += math.ceil(ctx / BLOCK)
        shares.append(used / NUM_BLOCKS)
    return statistics.fmean(shares) if shares else math.nan


def arrived_share(records: list[dict[str, Any]]) -> tuple[float, float]:
    """(requests per second sent, share of them finished while requests
    were still being sent)."""
    sends = sorted(r["send_time"] for r in records)
    span = sends[-1] - sends[0]
    done = sum(1 for r in records if r.get("end_time") is not None and r["end_time"] <= sends[-1])
    return len(sends) / span, done / len(sends)


def row(run: Path, records: list[dict[str, Any]], summary: dict[str, Any],
        trace: list[dict[str, Any]]) -> dict[str, Any]:
    rate, share = arrived_share(records)
    nl = summary["normalized_latency"]
    delays = sorted(r["prediction_delay_s"] for r in records
                    if r.get("prediction_delay_s") is not None)
    return {
        "run": run.name,
        "offered_req_s": rate,
        "finished_while_arriving": share,
        "throughput_req_s": summary["request_throughput"],
        "nl_mean": nl["mean"], "nl_p95": nl["p95"],
        "jct_mean": summary["e2e"]["mean"],
        "ttft_p99": summary["ttft"]["p99"],
        "preemptions": sum(len(e["preempted"]) for e in trace),
        "kv_utilization": kv_utilization(trace, records),
        "prediction_delay_p50": delays[len(delays) // 2] if delays else None,
        "prediction_delay_p90": delays[int(0.9 * len(delays))] if delays else None,
    }


def replay(run: Path, policy: str, tmp: Path, cost: Path | None = None) -> dict[str, Any]:
    """`run.sh`'s replay of `run`, again, with its records and trace; on
    `cost` (another run's cost table) instead of its own if given."""
    # Paused GTs drop their KV, as econoserve.yaml pins (the default swaps them).
    preds = {"econoserve": ["--predictions-from", f"{run}.json", "--sched-opt",
                            'econoserve={"pause_kv": "drop"}'],
             "mlfq-predicted": ["--predictions-from", f"{run}.json", "--sched-opt",
                                'mlfq={"skip_join": "predicted", "enst": "predicted"}']}
    sim_policy = "mlfq" if policy == "mlfq-predicted" else policy
    tag = "" if cost is None else ".common"
    out, tr = tmp / f"{run.name}{tag}.sim.json", tmp / f"{run.name}{tag}.sim.trace.json.gz"
    rc = bench_main(["simulate", "--workload-spec", f"{run}.json", "--cost-model",
                     str(cost or f"{run}.cost.json"), "--policy", sim_policy, *LIVE_SIM_ARGS,
                     *preds.get(policy, []), "--system", f"{policy}-sim", "--save-records",
                     "--out", str(out), "--trace-out", str(tr)])
    if rc:
        raise SystemExit(f"replay of {run} failed")
    return {"result": json.loads(out.read_text()), "trace": json.load(gzip.open(tr))["trace"]}


def decode_step_ms(trace: list[dict[str, Any]]) -> float:
    """Median decode-only iteration with 8-12 jobs: how fast the host ran."""
    xs = [e["iteration_time"] for e in trace
          if e["tokens"] == len(e["jobs"]) and 8 <= len(e["jobs"]) <= 12]
    return 1000 * statistics.median(xs) if xs else math.nan


def table(folder: Path, common: Path | None = None) -> list[dict[str, Any]]:
    """Live and replayed rows; with `common` (a cost table), each run also
    replayed on it, so that policies compare on one host speed."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for path in sorted((folder / "runs").glob("*.cost.json")):
            run = path.with_name(path.name.removesuffix(".cost.json"))
            policy, _, rate = run.name.rpartition("_")
            live = json.loads(Path(f"{run}.json").read_text())
            trace = json.load(gzip.open(f"{run}.trace.json.gz"))["trace"]
            sim = replay(run, policy, Path(d))
            rows.append({"policy": policy, "rate": float(rate), "kind": "live",
                         **row(run, live["records"], live["summary"], trace),
                         "decode_step_ms": decode_step_ms(trace)})
            rows.append({"policy": policy, "rate": float(rate), "kind": "simulated",
                         **row(run, sim["result"]["records"], sim["result"]["summary"],
                               sim["trace"])})
            if common is not None:
                sim = replay(run, policy, Path(d), common)
                rows.append({"policy": policy, "rate": float(rate), "kind": "common cost",
                             **row(run, sim["result"]["records"], sim["result"]["summary"],
                                   sim["trace"])})
    return sorted(rows, key=lambda r: (r["rate"], r["policy"], r["kind"]))


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| rate | policy | run | offered (req/s) | finished while arriving | "
            "mean / P95 NL (s/token) | mean JCT (s) | P99 TTFT (s) | preemptions | KV used | "
            "decode step (ms) |")
    lines = [head, "| " + " | ".join(["---"] * 11) + " |"]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['policy']} | {r['kind']} | {r['offered_req_s']:.3f} | "
            f"{100 * r['finished_while_arriving']:.1f} % | {r['nl_mean']:.4f} / {r['nl_p95']:.4f} | "
            f"{r['jct_mean']:.1f} | {r['ttft_p99']:.2f} | {r['preemptions']} | "
            f"{100 * r['kv_utilization']:.0f} % | {r.get('decode_step_ms', math.nan):.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("nl_mean", "nl_p95", "ttft_p99"),
                              ("mean NL (s/token)", "P95 NL (s/token)", "P99 TTFT (s)")):
        for i, policy in enumerate(sorted({r["policy"] for r in rows})):
            for kind, style in (("live", "-o"), ("common cost", ":s")):
                pts = [(r["rate"], r[key]) for r in rows
                       if r["policy"] == policy and r["kind"] == kind]
                if pts:
                    ax.plot(*zip(*pts), style, color=f"C{i}", label=f"{policy} ({kind})")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--common-cost", type=Path, default=None, metavar="COST.json",
                   help="also replay every run on this cost table (one host speed for all)")
    a = p.parse_args(argv)
    rows = table(a.folder, a.common_cost)
    print(markdown(rows))
    if a.out is not None:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    if a.plot is not None:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
