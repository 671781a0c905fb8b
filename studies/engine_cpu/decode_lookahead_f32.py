"""The decode operator's float32 look-ahead (the next sequence's blocks asked
for while the current one is computed on), off and on, alternated.

SmolLM2's heads (9 / 3 of 64), blocks of 16 tokens, one thread, a float32
cache; each call reads another of several disjoint sets of blocks (about
800 MB of K/V in all, as `decode_op_dram` does), so the K/V come from DRAM
as a served step's do.  `--run N`: each sequence's blocks in runs of N
consecutive ones (1: anywhere; the allocator's `block_run` is 8).  The
median of the second of two sweeps a setting, the settings alternated over
`--rounds`.  Prints ms a call and GB/s of K/V; writes JSON with `--out`.

    taskset -c 0 python -m studies.engine_cpu.decode_lookahead_f32 --batch 32 \\
        --context 128 --run 8 --rounds 4 \\
        --out studies/engine_cpu/decode_lookahead_f32_b32_c128_run8.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.report import machine_meta, write_report
from engine.cpp_build import avx512_half_width
from engine.cpp_ops import decode_lookahead_f32, load_kernel
from studies.engine_cpu.decode_op_dram import DIM, HEADS, KV_HEADS, block_sets, median_ms

BLOCK = 16


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--run", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    batch, context, run = args.batch, args.context, args.run
    per = context // BLOCK
    if context % BLOCK or per % run:
        parser.error(f"--context in blocks of {BLOCK}, --run dividing its {per} blocks")
    torch.set_num_threads(1)
    op = load_kernel()
    default = decode_lookahead_f32(False)
    need = batch * per
    num_sets = max(4, 800 * 2**20 // (need * BLOCK * KV_HEADS * DIM * 4 * 2))
    total = need * num_sets
    g = torch.Generator().manual_seed(0)
    k = torch.randn(total, BLOCK, KV_HEADS, DIM, generator=g)
    v = torch.randn(total, BLOCK, KV_HEADS, DIM, generator=g)
    sets = block_sets(total, need, run, num_sets, g)
    starts = torch.arange(batch) * per
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, DIM, generator=g)
    outs = {}
    for on in (False, True):
        decode_lookahead_f32(on)
        outs[on] = op(q, k, v, sets[0], starts, lens, DIM**-0.5)
    # A prefetch changes no value.
    assert torch.equal(outs[False], outs[True])
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            decode_lookahead_f32(on)
            ms = median_ms(op, q, k, v, sets, starts, lens)
            times["on" if on else "off"].append(ms)
            gbs = 2 * need * BLOCK * KV_HEADS * DIM * 4 / ms / 1e6
            print(f"round {r} look-ahead {'on ' if on else 'off'}: {ms:.2f} ms ({gbs:.1f} GB/s)",
                  flush=True)
    decode_lookahead_f32(default)
    write_report({"meta": machine_meta(), "zen4": avx512_half_width(), "batch": batch,
                  "context": context, "run": run, "sets": num_sets, "ms": times,
                  "default_on": default}, args.out)


if __name__ == "__main__":
    main()
