"""bf16 projections three ways on one CPU thread: `F.linear` on the plain
weight (oneDNN underneath where bf16 is native), oneDNN's matmul on its own
prepacked weight (`engine.models.prepacked`), and our kernel on its layout
(`engine.models.packed_bf16`): on AMX tiles where the build has them, then
also its VDPBF16PS vectors alone (`bf16_dot_vectors`).

SmolLM2's shapes (qkv 960 x 576, o 576 x 576, gate_up 3,072 x 576, down
576 x 1,536, the lm_head 49,152 x 576) at `--rows` input rows; each
projection's weight is one of 30 distinct copies (the lm_head one of 2),
used in turn, so that weights come from memory as in a decode step.
Medians of `--rounds` rounds, each timing the three in turn; GFLOP/s =
2 x rows x N x K / time.  Also the peak of the instruction on this core: a
2,048-row GEMM of the gate_up shape on our kernel (operands in cache), and
whether oneDNN's packed matmul returns our kernel's bits at each shape and
row count (`same_bits_as_onednn`).

    taskset -c 0 python -m studies.engine_cpu.gemm_bf16 --out studies/engine_cpu/gemm_bf16.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from bench.report import machine_meta, write_report
from engine.models import packed_bf16
from engine.models.prepacked import _ROWS_HINT, packed_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def _seconds(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor],
             min_s: float = 0.05) -> float:
    """Seconds per call, cycling through `weights`, over at least `min_s`."""
    for w in weights:
        fn(w)
    calls, start = 0, time.perf_counter()
    while True:
        for w in weights:
            fn(w)
        calls += len(weights)
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / calls


def measure(name: str, rows: int, rounds: int, kernel: ModuleType = packed_bf16,
            way: str = "bf16_dot", dtype: torch.dtype = torch.bfloat16,
            copies: int | None = None) -> dict[str, object]:
    """One projection's shape three ways; `kernel` (with its pack_projections
    name `way` and `dtype`) is ours: engine.models.packed_bf16 or .packed_f32.
    `copies`: distinct weights used in turn (default 30, the lm_head 2: from
    memory); 1 keeps the weight in the caches."""
    n, k = SHAPES[name]
    if copies is None:
        copies = 2 if name == "lm_head" else 30
    gen = torch.Generator().manual_seed(rows * 31 + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    plain = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for _ in range(copies)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, _ROWS_HINT) for w in plain]
    ours = [kernel.pack(w) for w in plain]
    ways: dict[str, tuple[Callable[[torch.Tensor], object], list[torch.Tensor]]] = {
        "f_linear": (lambda w: F.linear(x, w), plain),
        "onednn_packed": (lambda w: packed_linear(x, w), onednn),
        way: (lambda w: kernel.linear(x, w), ours),
    }
    # On a build with AMX, our kernel multiplies on the tiles; its vectors
    # alone are timed beside them (gemm_bf16_amx.h).
    tiles = kernel is packed_bf16 and packed_bf16.amx(True)
    if tiles:
        ways[f"{way}_vectors"] = (lambda w: kernel.linear(x, w), ours)
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(rounds):
        for name_, (fn, ws) in ways.items():
            vectors = name_.endswith("_vectors")
            if vectors:
                packed_bf16.amx(False)
            try:
                times[name_].append(_seconds(fn, ws))
            finally:
                if vectors:
                    packed_bf16.amx(True)
    flop = 2.0 * rows * n * k
    med = {way: statistics.median(t) for way, t in times.items()}
    # Whether oneDNN's packed matmul gives our kernel's bits at these rows
    # (could it stand in for ours at some batch without breaking batch
    # invariance?).
    same = torch.equal(kernel.linear(x, ours[0]), packed_linear(x, onednn[0]))
    return {"projection": name, "rows": rows, "n": n, "k": k, "same_bits_as_onednn": same,
            "us": {way: round(t * 1e6, 1) for way, t in med.items()},
            "gflops": {way: round(flop / t / 1e9, 1) for way, t in med.items()},
            f"{way}_over_onednn": round(med["onednn_packed"] / med[way], 3),
            f"{way}_over_f_linear": round(med["f_linear"] / med[way], 3)}


def peak(rounds: int, kernel: ModuleType = packed_bf16,
         dtype: torch.dtype = torch.bfloat16) -> float:
    n, k = SHAPES["gate_up"]
    x = torch.randn(2048, k).to(dtype)
    w = [kernel.pack(torch.randn(n, k).to(dtype))]
    t = statistics.median(_seconds(lambda v: kernel.linear(x, v), w)
                          for _ in range(rounds))
    return round(2.0 * 2048 * n * k / t / 1e9, 1)


def run(argv: list[str] | None, doc: str, kernel: ModuleType = packed_bf16,
        way: str = "bf16_dot", dtype: torch.dtype = torch.bfloat16, other: str = "onednn") -> None:
    """The command line of this study and of `gemm_f32.py` (its kernel as `measure`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,96,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--copies", type=int, default=None,
                    help="distinct weights used in turn (default 30, the lm_head 2); 1: from the caches where it fits")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if not kernel.built():
        raise SystemExit(f"no build of the operators with {way}'s kernel on this machine")
    base = "onednn_packed" if other == "onednn" else "f_linear"
    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        for name in SHAPES:
            r = measure(name, rows, a.rounds, kernel, way, dtype, a.copies)
            g: dict[str, float] = r["gflops"]  # type: ignore[assignment]
            vec = f"  vectors {g[way + '_vectors']:6.1f}" if way + "_vectors" in g else ""
            print(f"rows {rows:4d} {name:8s} F.linear {g['f_linear']:6.1f}  "
                  f"oneDNN packed {g['onednn_packed']:6.1f}  {way} {g[way]:6.1f}{vec} "
                  f"GFLOP/s  ({r[f'{way}_over_{other}']}x {base}; "
                  f"bits {'=' if r['same_bits_as_onednn'] else '!='} oneDNN's)")
            results.append(r)
    top = peak(a.rounds, kernel, dtype)
    print(f"{way}, 2,048 x 3,072 x 576 in cache: {top} GFLOP/s")
    write_report({"meta": {**machine_meta(), "threads": a.threads, "rounds": a.rounds,
                           "copies": a.copies},
                  "peak_gflops_2048_rows": top, "results": results}, a.out)


def main(argv: list[str] | None = None) -> None:
    run(argv, __doc__)


if __name__ == "__main__":
    main()
