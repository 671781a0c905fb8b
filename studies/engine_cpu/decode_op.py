"""The C++ paged decode operator alone, on one layer's worth of decodes.

SmolLM2's attention shape (9 query heads, 3 KV heads of 64, blocks of 16)
at `--batch` sequences of `--context` tokens, one thread, float32 and
bfloat16.  Two layouts of the cache:

- `cold`: each sequence's blocks drawn at random from a cache eight times
  larger than the batch needs (hundreds of MB), as a served batch's blocks
  are spread over the device cache; every block comes from memory;
- `hot`: every sequence reads the same blocks (one context's worth), which
  then stay in the CPU's caches, so that the time is the operator's
  arithmetic (what `bench.engine_bench` measures, whose decode batches share
  one prompt).

It times whatever `engine/csrc/paged_decode.cpp` holds when it runs (the
build is cached by source), so an earlier operator is timed by checking out
its source first.  Where the build has the AMX path
(`engine/csrc/paged_decode_amx.h`), bfloat16 is timed on it (`path: amx`)
and on the AVX512 vectors of the same build (`path: vectors`), alternated;
elsewhere each dtype once on what the build has (`path: build`).

    python -m studies.engine_cpu.decode_op --out studies/engine_cpu/decode_op.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench.report import machine_meta, write_report
from bench.sampling_bench import _median_ms
from engine.attention_cpp import bf16_dot_wanted, decode_amx, load_kernel


def _case(dtype: torch.dtype, batch: int, context: int, hot: bool, block_size: int = 16,
          heads: int = 9, kv_heads: int = 3, dim: int = 64) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(0)
    per = -(-context // block_size)
    needed = batch * per
    total = per if hot else needed * 8
    keys = torch.randn(total, block_size, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(total, block_size, kv_heads, dim, generator=gen).to(dtype)
    ids = torch.arange(needed) % per if hot else torch.randperm(total, generator=gen)[:needed]
    starts = torch.arange(batch, dtype=torch.long) * per
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    return q, keys, values, ids.long().contiguous(), starts, lens, dim ** -0.5


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.engine_cpu.decode_op",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    op = load_kernel()
    rows = []
    has_amx = decode_amx(True)
    for dtype in (torch.float32, torch.bfloat16):
        for hot in (False, True):
            args = _case(dtype, a.batch, a.context, hot)
            paths = ["amx", "vectors"] * 2 if dtype is torch.bfloat16 and has_amx else ["build"]
            for path in paths:
                decode_amx(path == "amx")
                op(*args)  # a first pass to touch the buffers
                ms = _median_ms(lambda: op(*args), a.reps)
                kv_bytes = 2 * a.batch * a.context * 3 * 64 * args[1].element_size()
                row = {"dtype": str(dtype).removeprefix("torch."),
                       "layout": "hot" if hot else "cold", "path": path,
                       "ms": round(ms, 3), "kv_gb_per_s": round(kv_bytes / ms / 1e6, 1)}
                rows.append(row)
                print(f"{row['dtype']:>9} {row['layout']:>4} {path:>7}: {ms:6.3f} ms "
                      f"({row['kv_gb_per_s']} GB/s of K/V)")
    decode_amx(True)
    meta = {"batch": a.batch, "context": a.context, "reps": a.reps, "threads": 1,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_dot_wanted": bf16_dot_wanted(), "amx": has_amx, **machine_meta()}
    write_report({"meta": meta, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
