"""Where the CPU goes while a burst's requests reach the engine.

Runs the 100-request ShareGPT burst (`python -m bench run … --rate inf`) against a running
server, reads every Serve process's CPU time (and the client's) from /proc every 50 ms
meanwhile, then the engine's plan trace (`python -m bench trace-live`), and reports the CPU
seconds each process took between the burst's first plan (less 0.4 s: the requests on
their way) and its first full iteration (at least `--full` tokens): the window in which the
engine runs small iterations because the rest of the burst has not reached it yet.
Also: each process's CPU over the whole run per request (with `--fixed 16 1`, 16-token
prompts and one output token, mostly the path's), and the intake: from the burst's first
request reaching the engine replica to its last (the trace's arrivals, on the plans'
clock), with the time from the client's start to the first arrival, and the median wait
from arrival to first plan.  `intake_from_plans_s` is the older figure, from the first plan
to the first plan of the burst's last job: a job that arrives during an iteration counts
from that iteration's end there, so one straggler moves it by a whole iteration.

    bash studies/burst/path_cpu.sh        # starts serve_b128_bf16.yaml, runs this, stops it
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from studies.serve_cpu import cpu_diff, cpu_s, serve_processes


class Sampler(threading.Thread):
    """Each process's CPU seconds (`studies/serve_cpu.py`) every `every_s`."""

    def __init__(self, processes: dict[str, str], every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.processes, self.every_s = processes, every_s
        self.rows: list[tuple[float, dict[str, float]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.rows.append((time.monotonic(), cpu_s(self.processes)))
            time.sleep(self.every_s)

    def cpu_between(self, t0: float, t1: float) -> tuple[float, dict[str, float]]:
        a = min(self.rows, key=lambda r: abs(r[0] - t0))
        b = min(self.rows, key=lambda r: abs(r[0] - t1))
        return b[0] - a[0], cpu_diff(a[1], b[1])


def intake(trace: dict[str, Any], started: float) -> dict[str, Any]:
    """How a burst sent at `started` reached the engine, from a live trace
    (`bench trace-live`): the span of its arrivals, the first one's delay, the
    median wait from arrival to a job's first plan, and the older bound from
    the plans alone (first plan to the last job's first plan)."""
    plans = [r for r in trace["trace"] if r["t"] >= started]
    # A request's first choice's job is the request id, the others `<id>#<i>`.
    arrived = {rid: t for t, rid in trace["arrivals"] if t >= started}
    planned: dict[str, float] = {}  # each job's first plan
    for r in plans:
        for j in r["jobs"]:
            planned.setdefault(j, r["t"])
    waits = [t - arrived[j.split("#", 1)[0]] for j, t in planned.items()
             if j.split("#", 1)[0] in arrived]
    return {
        "intake_s": max(arrived.values()) - min(arrived.values()),
        "first_arrival_after_start_s": min(arrived.values()) - started,
        "arrival_to_first_plan_median_s": statistics.median(waits),
        "requests_arrived": len(arrived),
        "intake_from_plans_s": max(planned.values()) - plans[0]["t"],
        "jobs_planned": len(planned),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.burst.path_cpu",
                                description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("-n", type=int, default=100)
    p.add_argument("--full", type=int, default=1500, help="tokens of a full iteration")
    p.add_argument("--fixed", type=int, nargs=2, metavar=("INPUT", "OUTPUT"),
                   help="fixed prompt and output tokens instead of ShareGPT's")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    dataset = (["--dataset", "sharegpt"] if a.fixed is None else
               ["--dataset", "fixed", "--input-len", str(a.fixed[0]),
                "--output-len", str(a.fixed[1])])
    processes = serve_processes()
    run_out = a.out.with_suffix(".run.json")
    started = time.monotonic()
    client = subprocess.Popen(
        [sys.executable, "-m", "bench", "run", *dataset, "-n", str(a.n),
         "--rate", "inf", "--seed", "0", "--base-url", a.base_url, "--endpoint", "completions",
         "--max-duration", "540", "--out", str(run_out)], stdout=subprocess.DEVNULL)
    processes[str(client.pid)] = "bench client"
    sampler = Sampler(processes)
    sampler.start()
    client.wait()
    sampler.stop.set()
    sampler.join()
    trace_out = a.out.with_suffix(".trace.json.gz")
    subprocess.run([sys.executable, "-m", "bench", "trace-live", "--out", str(trace_out)],
                   check=True, stdout=subprocess.DEVNULL)
    trace = json.loads(gzip.decompress(trace_out.read_bytes()))
    plans = [r for r in trace["trace"] if r["t"] >= started]
    first = plans[0]["t"]
    full = next((r["t"] for r in plans if r["tokens"] >= a.full), plans[-1]["t"])
    wall, cpu = sampler.cpu_between(first - 0.4, full)
    run_s = sampler.rows[-1][0] - sampler.rows[0][0]
    run_cpu = cpu_diff(sampler.rows[0][1], sampler.rows[-1][1])
    summary = json.loads(run_out.read_text())["summary"]
    doc: dict[str, Any] = {
        "command": "python -m studies.burst.path_cpu " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        **intake(trace, started),
        "window_s": wall, "first_full_iteration_after_first_plan_s": full - first,
        "plans_before_full": [{"jobs": len(r["jobs"]), "tokens": r["tokens"],
                               "iteration_time_s": r["iteration_time"]}
                              for r in plans if r["t"] < full],
        "cpu_s": dict(sorted(cpu.items(), key=lambda x: -x[1])),
        "run_s": run_s,
        "run_cpu_ms_per_request": {k: round(1e3 * v / a.n, 2) for k, v in sorted(
            run_cpu.items(), key=lambda x: -x[1])},
        "ttft_mean_s": summary["ttft"]["mean"], "ttft_p99_s": summary["ttft"]["p99"],
        "output_tokens_per_s": summary["output_token_throughput"],
    }
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"window {wall:.2f} s; first full iteration {full - first:.2f} s after the first plan;"
          f" intake {doc['intake_s']:.2f} s ({doc['requests_arrived']} arrivals; from plans"
          f" {doc['intake_from_plans_s']:.2f} s)")
    for k, v in doc["cpu_s"].items():
        print(f"  {v:6.2f} s  {k}  ({doc['run_cpu_ms_per_request'].get(k, 0):.2f} ms a request"
              " over the run)")


if __name__ == "__main__":
    main()
