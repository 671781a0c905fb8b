"""Our projections (engine.models.packed_bf16, packed_f32) on weights laid out
on 2 MiB pages against the same weights on 4 KiB pages, one CPU thread.

SmolLM2's shapes at `--rows` input rows, each projection's weight one of 30
distinct copies (the lm_head one of 2) used in turn, so that the weights
come from memory as in a decode step: `huge` packs all copies of a shape into
one arena from engine.huge_pages (as `pack_in_place` packs a model's
projections), `small` packs each into its own ordinary allocation
(`torch.ops.preempt_serve.pack_bf16` or `pack_f32`; 4 KiB pages where
transparent huge pages are `madvise` or `never`, as `meta.thp` records).
`--weights`: `bf16` (VDPBF16PS), `f32` (float32 values on the AVX2 FMA
kernel) or `f32_codes` (weights on a Q4_1 grid, kept as their GGUF codes,
a fifth of the bytes).  Medians of `--rounds` rounds, each timing both in
turn; GFLOP/s = 2 x rows x N x K / time.

    taskset -c 0 python -m studies.engine_cpu.gemm_huge_pages \\
        --out studies/engine_cpu/gemm_huge_pages.json
    taskset -c 0 python -m studies.engine_cpu.gemm_huge_pages --weights f32 --rows 1,8,32 \\
        --out studies/engine_cpu/gemm_huge_pages_f32.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from bench.report import machine_meta, write_report
from engine import huge_pages
from engine.models import packed_bf16, packed_f32
from studies.engine_cpu.gemm_bf16 import SHAPES, _seconds


def _weight(n: int, k: int, weights: str, gen: torch.Generator) -> torch.Tensor:
    if weights == "bf16":
        return (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    if weights == "f32":
        return torch.randn(n, k, generator=gen) / k**0.5
    # On a Q4_1 grid, as a GGUF weight decodes: every 32 along a row m + d q.
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half().float()
    m = (torch.rand(n, k // 32, 1, generator=gen) - 0.5).mul(0.2).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    q[:, :, 0], q[:, :, 1] = 0, 15
    return (d * q + m).reshape(n, k)


def _pack(w: torch.Tensor, weights: str) -> torch.Tensor:
    """Packed into an ordinary allocation, as the kernel's operator returns it."""
    if weights == "bf16":
        return torch.ops.preempt_serve.pack_bf16(w)
    if weights == "f32":
        return torch.ops.preempt_serve.pack_f32(w)
    packed = torch.ops.preempt_serve.pack_f32_codes(w)
    assert packed.numel(), "not on the grid"
    return packed


def measure(name: str, rows: int, rounds: int, weights: str = "bf16") -> dict[str, object]:
    n, k = SHAPES[name]
    copies = 2 if name == "lm_head" else 30
    gen = torch.Generator().manual_seed(rows * 31 + n)
    x = torch.randn(rows, k, generator=gen)
    x = x.bfloat16() if weights == "bf16" else x
    small = [_pack(_weight(n, k, weights, gen), weights) for _ in range(copies)]
    size = small[0].numel()
    arena = huge_pages.empty(copies * size, small[0].dtype)
    huge = [arena[i * size:(i + 1) * size].view(p.shape).copy_(p) for i, p in enumerate(small)]
    assert all(torch.equal(a, b) for a, b in zip(small, huge))
    linear = packed_bf16.linear if weights == "bf16" else packed_f32.linear
    ways = {"small": small, "huge": huge}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(rounds):
        for way, ws in ways.items():
            times[way].append(_seconds(lambda w: linear(x, w), ws))
    flop = 2.0 * rows * n * k
    med = {way: statistics.median(t) for way, t in times.items()}
    return {"projection": name, "rows": rows, "n": n, "k": k,
            "us": {way: round(t * 1e6, 1) for way, t in med.items()},
            "gflops": {way: round(flop / t / 1e9, 1) for way, t in med.items()},
            "huge_over_small": round(med["small"] / med["huge"], 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", choices=("bf16", "f32", "f32_codes"), default="bf16")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.weights == "bf16" and not packed_bf16.built():
        raise SystemExit("no AVX512-BF16 build of the operators on this machine")
    if a.weights != "bf16" and not packed_f32.built():
        raise SystemExit("no AVX2 FMA build of the operators on this machine")
    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        for name in SHAPES:
            r = measure(name, rows, a.rounds, a.weights)
            g: dict[str, float] = r["gflops"]  # type: ignore[assignment]
            print(f"rows {rows:4d} {name:8s} 4 KiB pages {g['small']:6.1f}  "
                  f"2 MiB pages {g['huge']:6.1f} GFLOP/s  ({r['huge_over_small']}x)")
            results.append(r)
    write_report({"meta": {**machine_meta(), "threads": a.threads, "rounds": a.rounds,
                           "weights": a.weights,
                           "thp": huge_pages.setting() or "unknown", "huge_pages_granted": huge_pages.on_huge_pages()},
                  "results": results}, a.out)


if __name__ == "__main__":
    main()
