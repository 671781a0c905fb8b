"""The C++ paged decode operator alone on K/V read from DRAM, not from L3.

`studies.engine_cpu.decode_op`'s "cold" layout reads the same blocks on
every repetition; on a host with a large L3 those stay there.  Here each
repetition reads another of 24 disjoint sets of blocks (batch 96 x 512
tokens: 38 MB of K/V a set, 900 MB in all; `--batch`, `--context` change
the shape and the number of sets with it), as a served step reads a
different layer's K/V each time.  bf16, SmolLM2's heads (9 / 3 of 64),
blocks of `--block` tokens (16), one thread; AMX tiles and vectors where the
build has both, and the AMX path over the same K/V in the tiles layout
(`engine/kv_layout.py`).  `--run N` gives each sequence its blocks in runs of N
consecutive ones (1: every block anywhere, as a served cache's blocks end up
after a while; N = context / block: each sequence's K and V one span apiece).
vLLM-CPU's operator on the same scheme: `vllm_cpu/attn_dram.py`.

    taskset -c 0 python -m studies.engine_cpu.decode_op_dram [--block 16] [--run 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from engine.attention_cpp import decode_amx, load_kernel
from engine.kv_layout import pack_keys, pack_values

HEADS, KV_HEADS, DIM = 9, 3, 64


def median_ms(op: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, sets: list[torch.Tensor], starts: torch.Tensor,
              lens: torch.Tensor) -> float:
    """The operator's median time over the second of two sweeps of `sets`
    (another set of blocks each call), in ms."""
    times = []
    for r in range(2 * len(sets)):
        t0 = time.perf_counter()
        op(q, k, v, sets[r % len(sets)], starts, lens, q.shape[-1]**-0.5)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[len(sets):]) * 1e3


def block_sets(total: int, need: int, run: int, num_sets: int,
               g: torch.Generator) -> list[torch.Tensor]:
    """`num_sets` disjoint lists of `need` block ids out of `total`, each in
    runs of `run` consecutive ids at random places."""
    starts_of_runs = torch.randperm(total // run, generator=g) * run
    per_set = need // run
    return [(starts_of_runs[i * per_set:(i + 1) * per_set].view(-1, 1) + torch.arange(run))
            .reshape(-1).long().contiguous() for i in range(num_sets)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--run", type=int, default=1)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args(argv)
    block, run = args.block, args.run
    batch, context = args.batch, args.context
    # Sets enough for ~900 MB of K/V in all, whatever the batch and context.
    num_sets = max(4, 24 * 512 * 96 // (context * batch))
    torch.set_num_threads(1)
    op = load_kernel()
    per = context // block
    if per % run:
        parser.error(f"--run must divide the {per} blocks of a sequence")
    need = batch * per
    total = need * num_sets
    g = torch.Generator().manual_seed(0)
    k = torch.randn(total, block, KV_HEADS, DIM, generator=g).bfloat16()
    v = torch.randn(total, block, KV_HEADS, DIM, generator=g).bfloat16()
    sets = block_sets(total, need, run, num_sets, g)
    starts = torch.arange(batch) * per
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, DIM, generator=g).bfloat16()
    amx = decode_amx(True)
    paths = ["amx", "tiles", "vectors"] * 2 if amx else ["build"]
    if amx:
        tiles_op = torch.ops.preempt_serve.paged_decode_tiles
        kt, vt = pack_keys(k), pack_values(v)
        same = tiles_op(q, kt, vt, sets[0], starts, lens, DIM**-0.5)
        ref = op(q, k, v, sets[0], starts, lens, DIM**-0.5)
        print(f"tiles against rows: max |diff| {(same.float() - ref.float()).abs().max():.2e}")
    for path in paths:
        decode_amx(path != "vectors")
        if path == "tiles":
            ms = median_ms(tiles_op, q, kt, vt, sets, starts, lens)
        else:
            ms = median_ms(op, q, k, v, sets, starts, lens)
        gbs = 2 * batch * context * KV_HEADS * DIM * 2 / ms / 1e6
        print(f"ours {path}, blocks of {block}, runs of {run}: {ms:.2f} ms ({gbs:.1f} GB/s of K/V)",
              flush=True)
    decode_amx(True)


if __name__ == "__main__":
    main()
