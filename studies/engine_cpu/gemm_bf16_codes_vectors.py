"""bf16 projections from their GGUF codes on VDPBF16PS (no AMX), against the
packed bf16 weights, one CPU thread: tried at commit f8f615d
(`engine/csrc/gemm_bf16_codes.cpp`'s `gemm_codes_vectors`, taken back out
after it; studies/engine_cpu/README.md, "GGUF codes under bf16 on
VDPBF16PS (tried, not kept)").

SmolLM2's four projection shapes, 30 layers of distinct Q4_1-shaped weights
multiplied in turn as in one decode step.  Each panel of 48 columns is
decoded into a per-thread buffer, then multiplied by gemm_bf16.cpp's
micro-kernel; `mix` k sends panels p with p % 4 < k to the bf16 values
instead (their lines asked into L2 while the panel before decodes), to see
whether the decode's arithmetic overlaps the values' stream.  Rounds
alternate the ways; medians; the products are checked to be the same bits.

    git checkout f8f615d  # the kernel it times
    taskset -c 0 python -m studies.engine_cpu.gemm_bf16_codes_vectors \\
        --out studies/engine_cpu/gemm_bf16_codes_vectors_zen4.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.report import machine_meta, write_report
from engine import attention_cpp
from engine.models import packed_bf16, weight_codes
from studies.engine_cpu.gemm_bf16_codes import SHAPES, q4_weight

WAYS = ("bf16", "mix0", "mix1", "mix2", "mix3")


def _pass(xs: dict[int, torch.Tensor], ws: list[torch.Tensor], ks: list[int]) -> float:
    t = time.perf_counter()
    for w, k in zip(ws, ks):
        packed_bf16.linear(xs[k], w)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    attention_cpp.load_kernel()
    if not packed_bf16.built() or packed_bf16.on_tiles():
        raise SystemExit("needs the operators' AVX512-BF16 build with the tiles off")
    setting = torch.ops.preempt_serve.set_codes_vector_rows
    setting(64)  # the codes at every row count measured
    gen = torch.Generator().manual_seed(0)
    plain: list[torch.Tensor] = []
    codes: list[torch.Tensor] = []
    ks: list[int] = []
    for _ in range(a.layers):
        for n, k in list(SHAPES.values())[:4]:
            w = q4_weight(n, k, gen)
            fitted = weight_codes.fit(w)
            assert fitted is not None
            plain.append(packed_bf16.pack(w.bfloat16()))
            codes.append(weight_codes.with_values(fitted, plain[-1]))
            ks.append(k)
    out = []
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}
        same = True
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        for _ in range(1 + a.rounds):
            for way in WAYS:
                if way != "bf16":
                    setting(1000 + int(way[-1]))
                    same = same and all(
                        torch.equal(packed_bf16.linear(xs[k], p), packed_bf16.linear(xs[k], c))
                        for p, c, k in zip(plain[:4], codes[:4], ks[:4]))
                times[way].append(_pass(xs, plain if way == "bf16" else codes, ks))
        med = {w: statistics.median(v[1:]) * 1e3 for w, v in times.items()}
        out.append({"rows": m, "ms": med,
                    "speedup": {w: med["bf16"] / v for w, v in med.items()},
                    "same_bits": same})
        print(out[-1])
    report = {"meta": {**machine_meta(), "layers": a.layers, "rounds": a.rounds,
                       "statistic": "median of the rounds",
                       "weights_mb": {"bf16": sum(p.numel() * 2 for p in plain) / 1e6,
                                      "codes": sum(c.numel() - p.numel() * 2
                                                   for p, c in zip(plain, codes)) / 1e6}},
              "results": out}
    write_report(report, a.out)


if __name__ == "__main__":
    main()
