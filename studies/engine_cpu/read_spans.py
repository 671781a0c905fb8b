"""How fast one core reads a cache whose contiguous pieces lie at random
places, by the size of a piece: the ceiling a decode operator meets when it
reads K/V from DRAM.

A served decode step reads every sequence's blocks, which lie anywhere in a
cache of GBs.  What one operator reads in a row is a contiguous span: with
our layout ([block, token, KV head, dim], K and V apart) a block's keys, 6 KB
at blocks of 16 tokens of SmolLM2 in bf16 (16 x 3 KV heads x 64 dims x 2 B)
and 48 KB at blocks of 128; with vLLM-CPU's (a block's K and V of one KV head
together) 8 KB at blocks of 32 and 32 KB at 128.  Here a loop of AVX512
loads, nothing else, reads 38 MB a repetition (one layer's K/V at batch 96 x
512 tokens) as spans of each size at random places of a 1.5 GB buffer, each
repetition another set of spans, one thread; then one 38 MB span.

    taskset -c 0 python -m studies.engine_cpu.read_spans --out studies/engine_cpu/read_spans.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.report import machine_meta, write_report

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>

// Reads spans of `span` bytes (a multiple of 256) at offsets `offs` of `buf`.
int64_t read_spans(torch::Tensor buf, torch::Tensor offs, int64_t span) {
  const char* b = reinterpret_cast<const char*>(buf.data_ptr<uint8_t>());
  const int64_t* o = offs.data_ptr<int64_t>();
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < offs.numel(); ++i) {
    const char* p = b + o[i];
    for (int64_t l = 0; l < span; l += 256) {
      acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + l));
      acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + l + 64));
      acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + l + 128));
      acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + l + 192));
    }
  }
  return _mm512_reduce_add_epi64(acc);
}
"""

BUFFER = 1536 << 20
PER_REP = 38 << 20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans-kb", default="6,8,16,32,48")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from torch.utils.cpp_extension import load_inline

    op = load_inline("preempt_serve_read_spans", cpp_sources=_SOURCE, functions=["read_spans"],
                     extra_cflags=["-O3", "-march=native"])
    torch.set_num_threads(1)
    buf = torch.randint(0, 255, (BUFFER,), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, object]] = []
    for rnd in range(args.rounds):
        for kb in [int(s) for s in args.spans_kb.split(",")]:
            span = kb << 10
            per = PER_REP // span
            perm = torch.randperm(BUFFER // span, generator=gen)
            sets = [(perm[i * per:(i + 1) * per] * span).contiguous()
                    for i in range(BUFFER // span // per)]
            times = []
            for offs in sets:
                t0 = time.perf_counter()
                op.read_spans(buf, offs, span)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            gbs = per * span / ms / 1e6
            rows.append({"round": rnd, "span_kb": kb, "ms": ms, "gb_per_s": gbs})
            print(f"round {rnd} spans of {kb:3d} KB: {ms:6.2f} ms, {gbs:4.1f} GB/s", flush=True)
        times = []
        for r in range(20):
            offs = torch.tensor([(r * PER_REP) % (BUFFER - PER_REP)])
            t0 = time.perf_counter()
            op.read_spans(buf, offs, PER_REP)
            times.append(time.perf_counter() - t0)
        gbs = PER_REP / statistics.median(times) / 1e9
        rows.append({"round": rnd, "span_kb": PER_REP >> 10, "gb_per_s": gbs})
        print(f"round {rnd} one span of 38 MB: {gbs:4.1f} GB/s", flush=True)
    write_report({"kind": "read_spans", "meta": machine_meta(), "per_repetition_bytes": PER_REP,
                  "rows": rows}, args.out)


if __name__ == "__main__":
    main()
