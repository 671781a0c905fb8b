"""Our bf16 GEMM's row chunks (`gemm_bf16.cpp`, `row_bytes`) on a burst's
prefills, quiet and beside a busy core.

The GEMM multiplies the rows of x in chunks of `row_bytes` against every
weight panel in turn, so a prefill of M rows streams each weight in from the
shared L3 (or memory) once per chunk.  This times the prefills of a served
burst (`studies/engine_cpu/vllm_cpu/burst_replay.py`: its prompt lengths,
shortest first, in iterations of at most 2,048 tokens; one thread) with each
chunk size in turn, round after round in one process (the setting is
switched by `preempt_serve::set_gemm_row_bytes`; the bits do not depend on
it), first with the other cores idle, then with `--busy-core` running the
Python and JSON work of a server's other processes.

    taskset -c 0 python -m studies.engine_cpu.gemm_row_chunks \\
        studies/engine_cpu/vllm_cpu/burst_mlfq_2026-12-04_1.json --busy-core 1 \\
        --out studies/engine_cpu/gemm_row_chunks_zen4.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import machine_meta, write_report
from studies.engine_cpu.vllm_cpu.burst_replay import Burst, burst_lens, busy_core


def rounds(burst: Burst, sizes: list[int], n: int) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {b: [] for b in sizes}
    for r in range(n):
        for b in sizes if r % 2 == 0 else sizes[::-1]:
            torch.ops.preempt_serve.set_gemm_row_bytes(b)
            out[b].append(round(burst.run(), 3))
            print(f"round {r} row_bytes {b // 1024} KiB: {out[b][-1]:.2f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path)
    ap.add_argument("--kib", default="192,512", help="row chunk sizes, KiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy-core", type=int, help="also time beside this core kept busy")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    sizes = [int(k) * 1024 for k in a.kib.split(",")]
    lens = burst_lens(a.records, "shortest")
    burst = Burst(lens, 2048, 1, 0, "auto")
    default = torch.ops.preempt_serve.set_gemm_row_bytes(0)
    burst.run()  # warm-up
    results: dict[str, Any] = {"quiet": rounds(burst, sizes, a.rounds)}
    if a.busy_core is not None:
        busy = busy_core(a.busy_core)
        try:
            time.sleep(1.0)
            results["busy"] = rounds(burst, sizes, a.rounds)
        finally:
            busy.kill()
    torch.ops.preempt_serve.set_gemm_row_bytes(default)
    summary = {cond: {f"{b // 1024}KiB": statistics.median(ts) for b, ts in res.items()}
               for cond, res in results.items()}
    print(summary)
    write_report({"meta": {**machine_meta(), "records": str(a.records), "prompt_tokens": sum(lens),
                           "default_row_bytes": default, "busy_core": a.busy_core},
                  "seconds": {c: {str(b): ts for b, ts in r.items()} for c, r in results.items()},
                  "median_s": summary}, a.out)


if __name__ == "__main__":
    main()
