"""SmolLM2's projections on their GGUF codes with row chunks of 4 MiB of x
(`engine/csrc/gemm_f32_codes.cpp`) against the 192 KiB chunks they took
before, one process, calls alternated.

Above six rows the codes GEMM decodes each 16-column panel into a buffer and
multiplies every row block of the chunk by it; each row chunk decodes every
panel again.  Both sizes are compiled from the repository's sources
(`PREEMPT_SERVE_CODES_ROW_BYTES`, with the AVX2 flags the engine's build
takes) into two study extensions, and SmolLM2's 120 projections, packed as
the engine packs them, are multiplied in turn by each at every row count,
in layer order, one thread.  Products are asserted bit-equal (the chunking
does not change the sums).  Runs where the engine takes `f32_fma`.

    taskset -c 1 python -m studies.engine_cpu.codes_chunks \\
        --out studies/engine_cpu/codes_chunks.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.cpp_extension import load_inline

from bench.engine_bench import OursBench, parse_args as bench_args
from bench.report import machine_meta, write_report
from engine.models import packed_f32

CSRC = Path(__file__).resolve().parents[2] / "engine" / "csrc"
SIZES = {"192KiB": 192 * 1024, "4MiB": 4 << 20}
OLD, NEW = tuple(SIZES)


def build(tag: str, row_bytes: int) -> Callable[..., torch.Tensor]:
    ns = f"preempt_serve_chunks_{tag.lower()}"
    # The operators register under a namespace of their own (the engine's
    # library registers the same names under `preempt_serve`).
    source = (f"#define preempt_serve {ns}\n"
              '#include "gemm_f32.cpp"\n#include "gemm_f32_codes.cpp"\n')
    load_inline(ns, cpp_sources=source, is_python_module=False,
                extra_cflags=["-O3", "-fno-math-errno", "-fno-trapping-math", "-mavx2", "-mfma",
                              "-mf16c", f"-DPREEMPT_SERVE_CODES_ROW_BYTES={row_bytes}",
                              f"-I{CSRC}"])
    return getattr(torch.ops, ns).linear_f32_codes


def weights() -> list[tuple[str, torch.Tensor]]:
    """SmolLM2's projections as the engine packs them, in layer order."""
    bench = OursBench(bench_args(["--decode-batches", "1", "--threads", "1",
                                  "--pack-projections", "f32_fma"]), "float32")
    model = bench.runner.model
    out = [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()]
           if packed_f32.code_format(t) is not None]
    assert out, "no projection on codes: run where the engine takes f32_fma"
    return out


def measure(ops: dict[str, Callable[..., torch.Tensor]], ws: list[tuple[str, torch.Tensor]],
            rows: int, rounds: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen)
          for k in {packed_f32.shape(w)[1] for _, w in ws}}
    for _, w in ws[:4]:
        x = xs[packed_f32.shape(w)[1]]
        first, *rest = (op(x, w, None) for op in ops.values())
        assert all(torch.equal(first, r) for r in rest)
    ms: dict[str, dict[str, list[float]]] = {tag: {} for tag in ops}
    for r in range(rounds):
        for tag in (list(ops) if r % 2 == 0 else list(reversed(ops))):
            per: dict[str, float] = {}
            for name, w in ws:
                x = xs[packed_f32.shape(w)[1]]
                t0 = time.perf_counter()
                ops[tag](x, w, None)
                kind = name.rsplit(".", 1)[-1]
                per[kind] = per.get(kind, 0.0) + (time.perf_counter() - t0) * 1e3
            for kind, t in per.items():
                ms[tag].setdefault(kind, []).append(t)
            ms[tag].setdefault("all", []).append(sum(per.values()))
    med = {tag: {k: round(statistics.median(v), 3) for k, v in d.items()}
           for tag, d in ms.items()}
    return {"rows": rows, "ms": med,
            "speedup": {k: round(med[OLD][k] / med[NEW][k], 3) for k in med[NEW]}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="32,96,512")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    ops = {tag: build(tag, size) for tag, size in SIZES.items()}
    ws = weights()
    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        row = measure(ops, ws, rows, a.rounds)
        print(row, flush=True)
        results.append(row)
    meta = {"projections": len(ws), "row_bytes": SIZES, "dtype": "float32", "threads": 1,
            "rounds": a.rounds, "statistic": "median", **machine_meta()}
    write_report({"meta": meta, "results": results}, a.out)


if __name__ == "__main__":
    main()
