"""`python -m bench trace-live | trace-summary`: plan traces of a live run
and of its simulation (`scheduler/trace.py`), side by side.

    python -m bench trace-live --out live_trace.json.gz     # after a live run
    python -m bench simulate --workload-spec RUN.json … --trace-out sim_trace.json.gz
    python -m bench trace-summary live_trace.json.gz sim_trace.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

from bench.cli_profile import add_call_args, answer, engine_handle
from scheduler.trace import StepTrace, summarize


def write_trace(path: Path, trace: list[dict[str, Any]], stats: dict[str, Any],
                arrivals: list[list[Any]] | None = None) -> None:
    """Plans, the server's stats and, from a live server, each request's
    arrival at the replica ([monotonic time, request id], the plans' clock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"kind": "trace", "stats": stats, "trace": trace}
    if arrivals is not None:
        doc["arrivals"] = arrivals
    text = json.dumps(doc)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    print(f"wrote {len(trace)} plans to {path}")


def read_trace(path: Path) -> list[StepTrace]:
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    if data.get("kind") != "trace":
        raise SystemExit(f"{path}: not a trace file (kind {data.get('kind')!r})")
    return [StepTrace(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()})
            for r in data["trace"]]


def cmd_trace_live(a: argparse.Namespace) -> int:
    handle = engine_handle(a)
    trace = answer(handle.step_trace.remote(), "Engine.step_trace", a.call_timeout)
    stats = answer(handle.stats.remote(), "Engine.stats", a.call_timeout)
    write_trace(a.out, trace["plans"], stats, trace["arrivals"])
    return 0


def cmd_trace_summary(a: argparse.Namespace) -> int:
    rows = {_label(p): summarize(read_trace(p), pingpong_s=a.pingpong_s) for p in a.traces}
    keys = list(next(iter(rows.values())))
    width = max(len(k) for k in keys)
    print(" " * width + "".join(f"  {name[-18:]:>18}" for name in rows))
    for k in keys:
        cells = "".join(f"  {_fmt(r[k]):>18}" for r in rows.values())
        print(f"{k:<{width}}{cells}")
    return 0


def _label(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".json", "_trace", ".trace"):
        name = name.removesuffix(suffix)
    return name


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def add_trace_parsers(sub: Any) -> None:
    q = sub.add_parser("trace-live", help="save the running server's plan trace")
    add_call_args(q)
    q.add_argument("--out", type=Path, required=True)
    q.set_defaults(func=cmd_trace_live)

    q = sub.add_parser("trace-summary", help="plan-trace counts of runs, side by side")
    q.add_argument("traces", type=Path, nargs="+")
    q.add_argument("--pingpong-s", type=float, default=1.0,
                   help="a swap-out this soon after the job's swap-in counts as ping-pong")
    q.set_defaults(func=cmd_trace_summary)
