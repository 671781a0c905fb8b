"""The C++ paged decode operator alone on K/V read from DRAM, not from L3.

`studies.engine_cpu.decode_op`'s "cold" layout reads the same blocks on
every repetition; on a host with a large L3 those stay there.  Here each
repetition reads another of `SETS` disjoint sets of blocks (batch 96 x 512
tokens: 38 MB of K/V a set, 900 MB in all), as a served step reads a
different layer's K/V each time.  bf16, SmolLM2's heads (9 / 3 of 64),
blocks of 16, one thread; AMX tiles and vectors where the build has both.
vLLM-CPU's operator on the same scheme: `vllm_cpu/attn_dram.py`.

    taskset -c 0 python -m studies.engine_cpu.decode_op_dram
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.attention_cpp import decode_amx, load_kernel

BATCH, CONTEXT, BLOCK, HEADS, KV_HEADS, DIM, SETS = 96, 512, 16, 9, 3, 64, 24


def main() -> None:
    torch.set_num_threads(1)
    op = load_kernel()
    per = CONTEXT // BLOCK
    need = BATCH * per
    total = need * SETS
    g = torch.Generator().manual_seed(0)
    k = torch.randn(total, BLOCK, KV_HEADS, DIM, generator=g).bfloat16()
    v = torch.randn(total, BLOCK, KV_HEADS, DIM, generator=g).bfloat16()
    perm = torch.randperm(total, generator=g)
    sets = [perm[i * need:(i + 1) * need].long().contiguous() for i in range(SETS)]
    starts = torch.arange(BATCH) * per
    lens = torch.full((BATCH,), CONTEXT)
    q = torch.randn(BATCH, HEADS, DIM, generator=g).bfloat16()
    paths = ["amx", "vectors"] * 2 if decode_amx(True) else ["build"]
    for path in paths:
        decode_amx(path == "amx")
        times = []
        for r in range(2 * SETS):
            t0 = time.perf_counter()
            op(q, k, v, sets[r % SETS], starts, lens, DIM**-0.5)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times[SETS:]) * 1e3
        gbs = 2 * BATCH * CONTEXT * KV_HEADS * DIM * 2 / ms / 1e6
        print(f"ours {path}: {ms:.2f} ms ({gbs:.1f} GB/s of K/V)", flush=True)
    decode_amx(True)


if __name__ == "__main__":
    main()
