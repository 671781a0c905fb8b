"""The steps of a `served_ab.sh` folder as one Markdown table, in the order given. Each
step's JSON is one of the script's three kinds:

- a served burst (`bench run --save-records`): output tokens/s, TTFT mean and P99, and when
  the burst's last first token came (seconds from its send, that request's prompt tokens);
- the intake (`PATH_CPU`, `path_cpu.py`): when the first request reached the engine, the
  span to the last, the median wait from arrival to first plan, the CPU a request of the
  ingress, Serve's HTTP proxy and the Scheduler, TTFT mean and P99;
- an idle server's time to first token (`CLIENT` running `prefill_probe.py`): the median
  and the least of each prompt length's repetitions.

    python -m studies.burst.table studies/burst/path_grpc n1 o1 v1 o2 n2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.records import RequestRecord


def burst(run: dict[str, Any]) -> tuple[list[str], list[str]]:
    s = run["summary"]
    records = [RequestRecord.model_validate(r) for r in run["records"]]
    firsts = [(r.ttft, r.prompt_tokens) for r in records if r.ttft is not None]
    last_s, last_prompt = max(firsts) if firsts else (float("nan"), 0)
    return (["output tok/s", "TTFT mean / P99 (s)", "last first token (s, prompt tokens)",
             "completed"],
            [f"{s['output_token_throughput']:.1f}",
             f"{s['ttft']['mean']:.2f} / {s['ttft']['p99']:.2f}",
             f"{last_s:.2f}, {last_prompt}", f"{s['num_completed']}/{s['num_requests']}"])


def intake(run: dict[str, Any]) -> tuple[list[str], list[str]]:
    cpu = run["run_cpu_ms_per_request"]
    return (["first arrival (s)", "first to last arrival (s)", "arrival to first plan, median (s)",
             "ingress / proxy / Scheduler CPU (ms a request)", "TTFT mean / P99 (s)"],
            [f"{run['first_arrival_after_start_s']:.2f}", f"{run['intake_s']:.2f}",
             f"{run['arrival_to_first_plan_median_s']:.2f}",
             f"{cpu.get('ingress', 0):.2f} / {cpu.get('http_proxy', 0):.2f} / "
             f"{cpu.get('scheduler', 0):.2f}",
             f"{run['ttft_mean_s']:.2f} / {run['ttft_p99_s']:.2f}"])


def idle(run: dict[str, Any]) -> tuple[list[str], list[str]]:
    lens = list(run["ttft"])
    return ([f"{n} tokens: median / least (ms)" for n in lens],
            [f"{run['ttft'][n]['median_ms']:.1f} / {run['ttft'][n]['min_ms']:.1f}"
             for n in lens])


def columns(run: dict[str, Any]) -> tuple[list[str], list[str]]:
    if "intake_s" in run:
        return intake(run)
    if "ttft" in run and "summary" not in run:
        return idle(run)
    return burst(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("steps", nargs="+")
    a = ap.parse_args()
    for i, step in enumerate(a.steps):
        head, cells = columns(json.loads((a.folder / f"{step}.json").read_text()))
        if i == 0:
            print("| run | " + " | ".join(head) + " |")
            print("| --- " * (len(head) + 1) + "|")
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
