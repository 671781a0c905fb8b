"""bf16 SiLU × up with silu(gate) looked up in a table of all 65,536 bf16
gates against computed by SLEEF's exp and a divide (engine/csrc/
silu_mul.cpp; switched in one process by `preempt_serve::set_silu_by_table`),
one CPU thread, the two ways alternated, in turn first (medians of
`--rounds`):

- the operator alone on one `[rows, 2 × 1,536]` GEMM output (SmolLM2's MLP)
  at each of `--rows`, with ATen's `F.silu(gate) * up` on its two halves
  beside it;
- whole bf16 steps of the engine in deterministic mode, the server's on CPU
  (`bench.engine_bench.OursBench`, greedy, lm_head and sampling included):
  prefills of `--step-lens` tokens and decode steps at `--batches` sequences
  of 128-token contexts, each its own.

    taskset -c 0 python -m studies.engine_cpu.silu_table \\
        --out studies/engine_cpu/silu_table_emr.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import engine.attention_cpp as cpp
from bench.report import machine_meta, write_report
from studies.engine_cpu.alternate import switched_steps

INTER = 1536
WAYS = (("computed", False), ("table", True))


def _ways(r: int) -> tuple[tuple[str, bool], ...]:
    """Round r's order: the ways swap places every round, so that neither
    always runs first."""
    return WAYS if r % 2 == 0 else WAYS[::-1]


def _table(on: bool) -> bool:
    return bool(torch.ops.preempt_serve.set_silu_by_table(on))


def _mean_ms(fn: Callable[[], object], reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def _op_rows(rows_list: list[int], rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows in rows_list:
        y = (torch.randn(rows, 2 * INTER, generator=gen) * 3).bfloat16()
        gate, up = y[:, :INTER], y[:, INTER:]
        reps = max(3, 20_000 // rows)
        times: dict[str, list[float]] = {"aten": [], "computed": [], "table": []}
        for r in range(rounds):
            times["aten"].append(_mean_ms(lambda: F.silu(gate) * up, reps))
            for way, on in _ways(r):
                _table(on)
                times[way].append(_mean_ms(lambda: torch.ops.preempt_serve.silu_mul(y), reps))
        row: dict = {"rows": rows, **{f"{w}_ms": round(statistics.median(ts), 4)
                                      for w, ts in times.items()}}
        row["speedup"] = round(row["computed_ms"] / row["table_ms"], 3)
        row["aten_over_table"] = round(row["aten_ms"] / row["table_ms"], 3)
        out.append(row)
        print(row, flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,96,512,1024,2048")
    ap.add_argument("--step-lens", default="128,512,1024")
    ap.add_argument("--batches", default="32,96")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cpp.load_kernel()
    if not _table(True):
        raise SystemExit("needs the operators' AVX512 build")
    try:
        op = _op_rows([int(x) for x in a.rows.split(",")], a.rounds)
        steps = switched_steps([int(x) for x in a.step_lens.split(",")],
                               [int(x) for x in a.batches.split(",")], WAYS, _table, a.rounds)
    finally:
        _table(True)
    write_report({"meta": {**machine_meta(), "rounds": a.rounds, "threads": 1,
                           "statistic": "median of the rounds"},
                  "operator": op, "steps": steps}, a.out)


if __name__ == "__main__":
    main()
