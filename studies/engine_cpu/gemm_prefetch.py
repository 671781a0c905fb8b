"""Where our bf16 GEMM prefetches the next weight panel (`gemm_bf16.cpp`,
`prefetch_hints`): per projection, then in the whole engine.

While the kernel multiplies a panel of 48 weight columns, it prefetches the
next panel's lines, spread over the K steps of the first row blocks.  The
hint says where they go: 3 the L1 (`_MM_HINT_T0`), 2 (T1), 1 (T2), or 0 no
prefetch at all; `preempt_serve::set_gemm_prefetch(rows, hint)` sets it for
one class of row chunks (one row, 2-16, 17-47, 48 and more).  The bits do
not depend on it.

1. SmolLM2's projections (`studies.engine_cpu.gemm_bf16`'s shapes, 30
   weight copies used in turn so that weights come from memory) at each of
   `--rows`, each hint in turn, `--rounds` rounds: GFLOP/s, medians.
2. Our engine in bfloat16 on one thread: prefills of `--prefill-lens`
   tokens and decode steps at `--batches` (256-token contexts) with the
   hints of this build's defaults against T0 at every row count, the two
   taking turns, `--rounds` rounds: ms, medians.

    taskset -c 0 python -m studies.engine_cpu.gemm_prefetch \\
        --out studies/engine_cpu/gemm_prefetch_zen4.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine_bench import OursBench
from bench.engine_bench import parse_args as engine_args
from bench.report import machine_meta, write_report
from engine.models import packed_bf16
from studies.engine_cpu.gemm_bf16 import SHAPES, _seconds

HINTS = (3, 2, 1, 0)
# One row count in each class of gemm_bf16.cpp's row_class.
CLASS_ROWS = (1, 8, 32, 64)


def hints() -> list[int]:
    """The hint of each row class now."""
    return [int(torch.ops.preempt_serve.set_gemm_prefetch(r, -1)) for r in CLASS_ROWS]


def set_hints(values: list[int]) -> None:
    for r, h in zip(CLASS_ROWS, values):
        torch.ops.preempt_serve.set_gemm_prefetch(r, h)


def projections(rows: list[int], rounds: int) -> list[dict[str, Any]]:
    out = []
    for m in rows:
        for name, (n, k) in SHAPES.items():
            if name == "lm_head":
                continue
            weights = [packed_bf16.pack(torch.randn(n, k).to(torch.bfloat16) * 0.05)
                       for _ in range(30)]
            x = torch.randn(m, k).to(torch.bfloat16)
            rates: dict[int, list[float]] = {h: [] for h in HINTS}
            first = None
            for _ in range(rounds):
                for h in HINTS:
                    set_hints([h] * len(CLASS_ROWS))
                    s = _seconds(lambda w: packed_bf16.linear(x, w), weights)
                    rates[h].append(2 * m * n * k / s / 1e9)
                    y = packed_bf16.linear(x, weights[0])
                    first = y if first is None else first
                    assert torch.equal(first, y), "the bits changed with the prefetch hint"
            med = {h: round(statistics.median(v), 1) for h, v in rates.items()}
            print(f"rows {m:4d} {name:8s} " + "  ".join(f"hint {h} {v:6.1f}"
                                                        for h, v in med.items()), flush=True)
            out.append({"rows": m, "shape": name, "gflops": {str(h): v for h, v in med.items()}})
    return out


def engine(prefill_lens: list[int], batches: list[int], rounds: int, tuned: list[int],
           steps: int = 6) -> list[dict[str, Any]]:
    args = engine_args(["--decode-context", "256", "--decode-steps", str(steps + 1),
                        "--warmup", "0", "--threads", "1",
                        "--prefill-lens", ",".join(map(str, prefill_lens)),
                        "--decode-batches", ",".join(map(str, batches))])
    bench = OursBench(args, "bfloat16")
    variants = {"t0": [3] * len(CLASS_ROWS), "tuned": tuned}
    prompt = [100 + (i * 7919) % 40000 for i in range(max(*prefill_lens, 256))]
    out = []
    cases = [("prefill", n) for n in prefill_lens] + [("decode", b) for b in batches]
    for kind, size in cases:
        ms: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(rounds):
            for v in variants if r % 2 == 0 else list(variants)[::-1]:
                set_hints(variants[v])
                if kind == "prefill":
                    bench.prefill(prompt[:size])
                    times = []
                    for _ in range(3):
                        t = time.perf_counter()
                        bench.prefill(prompt[:size])
                        times.append(time.perf_counter() - t)
                else:
                    one_step = bench.start_decode(prompt[:256], size)
                    one_step()
                    times = [one_step() for _ in range(steps - 1)]
                ms[v].append(statistics.median(times) * 1000)
        med = {v: round(statistics.median(t), 2) for v, t in ms.items()}
        ratio = round(med["t0"] / med["tuned"], 3)
        print(f"{kind} {size:4d}: T0 {med['t0']:8.2f} ms  tuned {med['tuned']:8.2f} ms  "
              f"({ratio}x)", flush=True)
        out.append({"kind": kind, "size": size, "ms": ms, "median_ms": med,
                    "speedup": ratio})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,128,512")
    ap.add_argument("--prefill-lens", default="16,128,512")
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    assert packed_bf16.built(), "no AVX512-BF16 build of the operators here"
    tuned = hints()
    print("this build's hints by row class (1, 2-16, 17-47, 48+):", tuned)
    proj = projections([int(r) for r in a.rows.split(",")], a.rounds)
    eng = engine([int(n) for n in a.prefill_lens.split(",")],
                 [int(b) for b in a.batches.split(",")], a.rounds, tuned)
    set_hints(tuned)
    write_report({"meta": {**machine_meta(), "default_hints": tuned, "rounds": a.rounds},
                  "projections": proj, "engine": eng}, a.out)


if __name__ == "__main__":
    main()
