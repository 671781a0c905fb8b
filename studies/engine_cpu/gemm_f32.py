"""float32 projections three ways on one CPU thread: `F.linear` on the plain
weight (MKL's sgemm), oneDNN's matmul on its own prepacked weight
(`engine.models.prepacked`), and our AVX2 FMA kernel on its layout
(`engine.models.packed_f32`), at SmolLM2's shapes with weights drawn from
memory as in a decode step (`gemm_bf16.py` says how each is timed).  Also
the kernel's rate on a 2,048-row GEMM of the gate_up shape (operands in
cache), near the core's FMA peak.

    taskset -c 1 python -m studies.engine_cpu.gemm_f32 --out studies/engine_cpu/gemm_f32.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.report import machine_meta, write_report
from engine.models import packed_f32
from studies.engine_cpu.gemm_bf16 import SHAPES, measure, peak


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,96,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if not packed_f32.built():
        raise SystemExit("no AVX2 FMA build of the operators on this machine")
    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        for name in SHAPES:
            r = measure(name, rows, a.rounds, packed_f32, "f32_fma", torch.float32)
            g: dict[str, float] = r["gflops"]  # type: ignore[assignment]
            print(f"rows {rows:4d} {name:8s} F.linear {g['f_linear']:6.1f}  "
                  f"oneDNN packed {g['onednn_packed']:6.1f}  f32_fma {g['f32_fma']:6.1f} "
                  f"GFLOP/s  ({r['f32_fma_over_f_linear']}x F.linear)")
            results.append(r)
    top = peak(a.rounds, packed_f32, torch.float32)
    print(f"f32_fma, 2,048 x 3,072 x 576 in cache: {top} GFLOP/s")
    write_report({"meta": {**machine_meta(), "threads": a.threads, "rounds": a.rounds},
                  "peak_gflops_2048_rows": top, "results": results}, a.out)


if __name__ == "__main__":
    main()
