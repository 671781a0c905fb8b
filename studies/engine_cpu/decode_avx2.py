"""The float32 decode operator's AVX2 passes against its portable loop, one
build, one process, calls alternated.

An AVX2 build of `engine/csrc/paged_decode.cpp` sends float32 decodes to
`paged_decode_avx2.h`; the portable loop beside it is what they took before.
Here both are compiled from the repository's sources into one study
extension (the operator's file included whole, with the AVX2 flags the
engine's build takes) and called in turn over the same K/V: SmolLM2's heads
(9 / 3 of 64), blocks of 16 tokens at random places, one thread.  "cold":
each call reads another of 30 disjoint sets of blocks (a served step reads
another layer's K/V each time; 6 MB a set at batch 32 x 128 tokens, more
than this host's L3 in all); "hot": one set, which stays in the caches.
Outputs are asserted equal to within float32 rounding.  Runs in a process
of its own (the extension registers the same operators as the engine's).

    taskset -c 1 python -m studies.engine_cpu.decode_avx2 \\
        --out studies/engine_cpu/decode_avx2.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.cpp_extension import load_inline

from bench.report import machine_meta, write_report

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
CSRC = Path(__file__).resolve().parents[2] / "engine" / "csrc"

_SOURCE = """
#include "paged_decode.cpp"
at::Tensor study_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                        const at::Tensor& ids, const at::Tensor& starts,
                        const at::Tensor& ctx, double scale, bool avx2) {
  at::Tensor out = at::empty_like(q);
  const int64_t n = q.size(0), heads = q.size(1), bs = kc.size(1), kvh = kc.size(2);
  if (avx2) {
    decode_avx2<64>(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                    ids.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                    ctx.data_ptr<int64_t>(), scale, out.data_ptr<float>(), n, heads, kvh, bs);
  } else {
    decode<float, 64>(64, q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                      ids.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                      ctx.data_ptr<int64_t>(), scale, out.data_ptr<float>(), n, heads, kvh, bs);
  }
  return out;
}
"""


def build() -> Any:
    return load_inline(
        "preempt_serve_decode_avx2_study", cpp_sources=_SOURCE, functions=["study_decode"],
        extra_cflags=["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
                      "-mavx2", "-mfma", "-mf16c", f"-I{CSRC}"])


def measure(ext: Any, batch: int, context: int, cold: bool, rounds: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(batch * 1000 + context)
    per_set = batch * (context // BLOCK)
    sets = LAYERS if cold else 1
    total = per_set * sets
    keys = torch.randn(total, BLOCK, KV_HEADS, DIM, generator=gen)
    values = torch.randn(total, BLOCK, KV_HEADS, DIM, generator=gen)
    perm = torch.randperm(total, generator=gen)
    tables = [perm[s * per_set:(s + 1) * per_set].contiguous() for s in range(sets)]
    q = torch.randn(batch, HEADS, DIM, generator=gen)
    starts = torch.arange(batch) * (context // BLOCK)
    lens = torch.full((batch,), context)
    scale = DIM ** -0.5
    for t in tables[:2]:
        a = ext.study_decode(q, keys, values, t, starts, lens, scale, False)
        b = ext.study_decode(q, keys, values, t, starts, lens, scale, True)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ms: dict[str, list[float]] = {"portable": [], "avx2": []}
    for _ in range(rounds):
        for name in ms:
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                ext.study_decode(q, keys, values, tables[layer % sets], starts, lens, scale,
                                 name == "avx2")
            ms[name].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {"batch": batch, "context": context, "kv": "cold" if cold else "hot",
            "ms_per_30_layers": {k: round(v, 3) for k, v in med.items()},
            "speedup": round(med["portable"] / med["avx2"], 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x128,8x512,32x128,16x1024",
                   help="batch x context pairs")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    ext = build()
    rows = []
    for shape in a.shapes.split(","):
        b, c = (int(x) for x in shape.split("x"))
        for cold in (True, False):
            row = measure(ext, b, c, cold, a.rounds)
            print(row, flush=True)
            rows.append(row)
    meta = {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block": BLOCK,
            "dtype": "float32", "threads": 1, "rounds": a.rounds, "statistic": "median",
            **machine_meta()}
    write_report({"meta": meta, "results": rows}, a.out)


if __name__ == "__main__":
    main()
