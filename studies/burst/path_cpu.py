"""Where the CPU goes while a burst's requests reach the engine.

Runs the 100-request ShareGPT burst (`python -m bench run … --rate inf`) against a running
server, reads every Serve process's CPU time (and the client's) from /proc every 50 ms
meanwhile, then the engine's plan trace (`python -m bench trace-live`), and reports the CPU
seconds each process took between the burst's first plan (less 0.4 s: the requests on
their way) and its first full iteration (at least `--full` tokens): the window in which the
engine runs small iterations because the rest of the burst has not reached it yet.

    bash studies/burst/path_cpu.sh        # starts serve_b128_bf16.yaml, runs this, stops it
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_SERVE = ("ServeReplica", "ProxyActor", "ServeController", "gcs_server", "raylet")


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _ticks(pid: str) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime + stime


class Sampler(threading.Thread):
    def __init__(self, pids: dict[str, str], every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pids, self.every_s = pids, every_s
        self.rows: list[tuple[float, dict[str, int]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            row = {pid: t for pid in list(self.pids) if (t := _ticks(pid)) is not None}
            self.rows.append((now, row))
            time.sleep(self.every_s)

    def cpu_between(self, t0: float, t1: float) -> tuple[float, dict[str, float]]:
        a = min(self.rows, key=lambda r: abs(r[0] - t0))
        b = min(self.rows, key=lambda r: abs(r[0] - t1))
        hz = os.sysconf("SC_CLK_TCK")
        return b[0] - a[0], {self.pids[p]: (v - a[1].get(p, v)) / hz for p, v in b[1].items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.burst.path_cpu",
                                description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("-n", type=int, default=100)
    p.add_argument("--full", type=int, default=1500, help="tokens of a full iteration")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    pids = {pid: _cmdline(pid)[:60].strip() for pid in os.listdir("/proc") if pid.isdigit()
            and any(k in _cmdline(pid) for k in _SERVE)}
    run_out = a.out.with_suffix(".run.json")
    started = time.monotonic()
    client = subprocess.Popen(
        [sys.executable, "-m", "bench", "run", "--dataset", "sharegpt", "-n", str(a.n),
         "--rate", "inf", "--seed", "0", "--base-url", a.base_url, "--endpoint", "completions",
         "--max-duration", "540", "--out", str(run_out)], stdout=subprocess.DEVNULL)
    pids[str(client.pid)] = "bench client"
    sampler = Sampler(pids)
    sampler.start()
    client.wait()
    sampler.stop.set()
    sampler.join()
    trace_out = a.out.with_suffix(".trace.json.gz")
    subprocess.run([sys.executable, "-m", "bench", "trace-live", "--out", str(trace_out)],
                   check=True, stdout=subprocess.DEVNULL)
    plans = [r for r in json.loads(gzip.decompress(trace_out.read_bytes()))["trace"]
             if r["t"] >= started]
    first = plans[0]["t"]
    full = next(r["t"] for r in plans if r["tokens"] >= a.full)
    wall, cpu = sampler.cpu_between(first - 0.4, full)
    summary = json.loads(run_out.read_text())["summary"]
    doc: dict[str, Any] = {
        "command": "python -m studies.burst.path_cpu " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "window_s": wall, "first_full_iteration_after_first_plan_s": full - first,
        "plans_before_full": [{"jobs": len(r["jobs"]), "tokens": r["tokens"],
                               "iteration_time_s": r["iteration_time"]}
                              for r in plans if r["t"] < full],
        "cpu_s": {k: round(v, 3) for k, v in sorted(cpu.items(), key=lambda x: -x[1])
                  if v > 0.005},
        "ttft_mean_s": summary["ttft"]["mean"], "ttft_p99_s": summary["ttft"]["p99"],
        "output_tokens_per_s": summary["output_token_throughput"],
    }
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"window {wall:.2f} s; first full iteration {full - first:.2f} s after the first plan")
    for k, v in doc["cpu_s"].items():
        print(f"  {v:6.2f} s  {k}")


if __name__ == "__main__":
    main()
