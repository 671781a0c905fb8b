"""Where a served decode step's time goes, ours beside vLLM-CPU's.

Reads a `py-spy record --native -f raw` profile of each server's compute
process taken during a `bench run` (`served_profile.sh`), and that run's
records: the share of the compute thread's samples in each kind of work
(attention, linear layers, the rest), turned into ms an iteration with the
iteration time inside the profile's window (requests running over output
tokens a second), beside how long their contexts were.  Both servers run
under the profiler's pauses alike, so the two are compared with each other,
not with unprofiled runs.

    python -m studies.engine_cpu.vllm_cpu.served_profile \\
        --ours OURS_RAW OURS_JSON --vllm VLLM_RAW VLLM_JSON --window 20 45 \\
        --out studies/engine_cpu/vllm_cpu/served_profile_1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from bench.report import write_report

# (category, substrings of a stack's function names); the first match wins.
# Only function names are matched: a library's file name (ours are all in
# preempt_serve_paged_decode_*.so) says nothing of the function.
OURS = ("EngineLoop._iterate", [
    ("attention", ("decode<", "paged_decode(", "paged_prefill")),
    ("linear", ("mkldnn", "dnnl", "brgemm", "packed_linear")),
    ("silu x up", ("silu_mul",)),
    ("norms", ("rms_norm",)),
    ("rotary", ("rotary",)),
    ("kv write", ("write_kv",)),
    ("argmax", ("argmax",)),
])
VLLM = ("GPUModelRunner.execute_model", [
    ("attention", ("cpu_attention",)),
    ("linear", ("dnnl", "onednn", "brgemm")),
    ("kv write", ("kv_cache_update",)),
])


def shares(raw: Path, root: str, rules: list[tuple[str, tuple[str, ...]]]) -> tuple[int, Counter[str]]:
    """Samples under `root`, and how many fall in each category."""
    total, cats = 0, Counter[str]()
    for line in raw.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        if root not in stack:
            continue
        names = ";".join(f.split(" (")[0] for f in stack.split(";"))
        total += int(n)
        cat = next((c for c, keys in rules if any(k in names for k in keys)), "other")
        cats[cat] += int(n)
    return total, cats


def window_stats(records: list[dict[str, Any]], lo: float, hi: float) -> dict[str, float]:
    """In [lo, hi) s of the run: output tokens a second, requests running
    and their mean context, and the time of an iteration that gives every
    running request a token (running / tokens a second); the median gap
    between a request's tokens too (coarser: tokens reach the client in
    batches)."""
    tokens = sum(1 for r in records for t in r["token_times"] if lo <= t < hi)
    gaps = [b - a for r in records for a, b in zip(r["token_times"], r["token_times"][1:])
            if lo <= b < hi]
    running, contexts = [], []
    for t in range(int(lo), int(hi)):
        live = [r for r in records if r["send_time"] <= t < r["end_time"]]
        running.append(len(live))
        contexts.extend(r["prompt_tokens"] + sum(1 for x in r["token_times"] if x <= t)
                        for r in live)
    per_s = tokens / (hi - lo)
    return {"tokens_per_s": per_s, "running_mean": statistics.fmean(running),
            "context_mean": statistics.fmean(contexts) if contexts else 0.0,
            "step_ms": statistics.fmean(running) / per_s * 1e3,
            "median_gap_ms": statistics.median(gaps) * 1e3}


def system(raw: Path, bench: Path, spec: tuple[str, list[tuple[str, tuple[str, ...]]]],
           lo: float, hi: float) -> dict[str, Any]:
    total, cats = shares(raw, *spec)
    run = json.loads(bench.read_text())
    stats = window_stats(run["records"], lo, hi)
    step = stats["step_ms"]
    summary = run["summary"]
    return {
        "samples": total, **{k: round(v, 2) for k, v in stats.items()},
        "output_tokens_per_s": round(summary["output_token_throughput"], 1),
        "share": {c: round(n / total, 4) for c, n in cats.most_common()},
        "ms_per_step": {c: round(n / total * step, 1) for c, n in cats.most_common()},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.engine_cpu.vllm_cpu.served_profile",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--ours", nargs=2, type=Path, metavar=("RAW", "BENCH_JSON"), required=True)
    ap.add_argument("--vllm", nargs=2, type=Path, metavar=("RAW", "BENCH_JSON"), required=True)
    ap.add_argument("--window", nargs=2, type=float, default=[20.0, 45.0],
                    help="seconds of the run the profiles cover")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    lo, hi = a.window
    doc = {"window_s": [lo, hi],
           "ours": system(*a.ours, OURS, lo, hi), "vllm_cpu": system(*a.vllm, VLLM, lo, hi)}
    print(json.dumps(doc, indent=1))
    write_report(doc, a.out)


if __name__ == "__main__":
    main()
