"""Launch parameters of the Triton attention kernels, swept on one GPU.

For a Llama-3-8B attention layer (32 query heads over 8 KV heads of 128,
bf16, 16-token blocks scattered over the cache), each launch replayed 20
times from a CUDA graph so that host launch cost stays out:

- `_paged_decode` (+ `_merge_splits` where the context is split) at several
  batch sizes and contexts, per (keys per tile, warps, pipeline stages),
  against the layer's KV bytes at the measured copy bandwidth;
- `_paged_prefill` of one fresh prompt per (query rows, keys per tile,
  warps, stages), against the causal attention's FLOPs at the measured bf16
  matmul rate and against `scaled_dot_product_attention` (is_causal) on the
  same dense q / k / v.

    python -m studies.engine_gpu.kernel_sweep --out studies/engine_gpu/sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import numpy as np
import torch
import triton

from engine import attention_triton as at
from engine.attention import SeqSpan


def graph_time(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    heads, kvh, hd, bs = 32, 8, 128, 16
    # Copied eagerly: the same copy replayed from a graph (a memcpy node, not
    # a copy kernel) measured 2.8 TB/s on an H200 that copies at 4.2 eagerly.
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    copies = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        copies.append(start.elapsed_time(end) / 1e3)
    bw = 2 * src.numel() * 2 / statistics.median(copies)
    del src, dst
    backend = at.TritonAttentionBackend(heads, kvh, hd, bs, dev)
    rows = []
    for b, ctx in [(1, 512), (32, 512), (128, 512), (1, 4096)]:
        num_blocks = b * (ctx // bs + 1) + 64
        gen = torch.Generator().manual_seed(0)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        spans = [SeqSpan(ctx - 1, 1, perm[i * (ctx // bs + 1):(i + 1) * (ctx // bs + 1)])
                 for i in range(b)]
        key = torch.randn(num_blocks, bs, kvh, hd, dtype=torch.bfloat16, device=dev)
        value = torch.randn_like(key)
        q = torch.randn(b, heads, hd, dtype=torch.bfloat16, device=dev)
        md = backend.build_metadata(spans)
        out = torch.empty_like(q)
        kv_bytes = 2 * b * ctx * kvh * hd * 2
        for tile, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 3)):
            # The backend's own split rule, for this tile.
            programs = b * kvh
            want = max(1, -(-at.PROGRAMS_PER_SM * backend.num_sms // programs))
            tiles = -(-ctx // tile)
            splits = min(want, tiles)
            split_len = -(-tiles // splits) * tile
            splits = -(-ctx // split_len)
            part_out = torch.empty(b, heads, splits, backend.block_d, dtype=torch.float32,
                                   device=dev)
            part_lse = torch.empty(b, heads, splits, dtype=torch.float32, device=dev)

            def launch() -> None:
                at._paged_decode[(b, kvh, splits)](
                    q, key, value, md.block_tables, md.decode_context, out, part_out, part_lse,
                    hd**-0.5, q.stride(0), q.stride(1), md.block_tables.stride(0), split_len,
                    HEAD_DIM=hd, BLOCK_D=backend.block_d, NUM_KV_HEADS=kvh,
                    GROUP=backend.group, BLOCK_G=backend.block_g, BLOCK_SIZE=bs, TILE_N=tile,
                    NUM_SPLITS=splits, PRECISION=None, DOT_F32=False,
                    num_warps=warps, num_stages=stages)
                if splits > 1:
                    at._merge_splits[(b, heads)](
                        out, part_out, part_lse, md.decode_context, split_len,
                        out.stride(0), out.stride(1), HEAD_DIM=hd, BLOCK_D=backend.block_d,
                        NUM_HEADS=heads, NUM_SPLITS=splits,
                        TILE_S=min(16, triton.next_power_of_2(splits)))

            try:
                t = graph_time(launch)
            except Exception as e:  # a configuration the compiler rejects
                print(f"b={b} ctx={ctx} tile={tile} warps={warps} stages={stages}: {e}")
                continue
            rows.append({"batch": b, "context": ctx, "tile": tile, "warps": warps,
                         "stages": stages, "splits": splits, "s": t,
                         "fraction_of_floor": kv_bytes / bw / t})
        best = max((r for r in rows if r["batch"] == b and r["context"] == ctx),
                   key=lambda r: r["fraction_of_floor"])
        cur = next(r for r in rows if r["batch"] == b and r["context"] == ctx
                   and (r["tile"], r["warps"], r["stages"]) == (at.DECODE_TILE, at.DECODE_WARPS,
                                                               at.DECODE_STAGES))
        print(f"b={b:4d} ctx={ctx:5d}: current {cur['s'] * 1e6:6.1f} us "
              f"({100 * cur['fraction_of_floor']:.0f}%); best tile={best['tile']} "
              f"warps={best['warps']} stages={best['stages']} {best['s'] * 1e6:6.1f} us "
              f"({100 * best['fraction_of_floor']:.0f}%)", flush=True)
    prefill_rows = sweep_prefill(backend, dev)
    args.out.write_text(json.dumps({"copy_bytes_per_s": bw, "rows": rows,
                                    "prefill": prefill_rows}, indent=1))


def sweep_prefill(backend: at.TritonAttentionBackend, dev: torch.device) -> list[dict]:
    import torch.nn.functional as F

    heads, kvh, hd, bs = backend.num_heads, backend.num_kv_heads, backend.head_dim, 16
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    rate = 2 * 8192**3 / graph_time(lambda: a @ a, 5)
    rows: list[dict] = []
    for n in (512, 2048):
        blocks = n // bs
        gen = torch.Generator().manual_seed(1)
        table = torch.randperm(blocks + 32, generator=gen)[:blocks].tolist()
        key = torch.randn(blocks + 32, bs, kvh, hd, dtype=torch.bfloat16, device=dev)
        value = torch.randn_like(key)
        q = torch.randn(n, heads, hd, dtype=torch.bfloat16, device=dev)
        md = backend.build_metadata([SeqSpan(0, n, table)])
        out = torch.empty_like(q)
        one = np.zeros(1, np.int64)
        tiles_for = {tm: torch.from_numpy(at.prefill_tiles(one, one + n, one, one, tm)
                                          .astype(np.int32)).to(dev) for tm in (64, 128)}
        flops = 4 * heads * hd * n * n / 2
        idx = torch.tensor(table, device=dev)
        kd = key.index_select(0, idx).view(n, kvh, hd).transpose(0, 1)[None]
        vd = value.index_select(0, idx).view(n, kvh, hd).transpose(0, 1)[None]
        qd = q.transpose(0, 1)[None]
        try:
            sdpa: float | None = graph_time(lambda: F.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, scale=hd**-0.5, enable_gqa=True))
        except Exception as e:  # a backend that cannot be captured
            print(f"sdpa {n}: {type(e).__name__}: {e}")
            sdpa = None
        for tm, tn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            def launch() -> None:
                tiles = tiles_for[tm]
                at._paged_prefill[(tiles.shape[1], heads)](
                    q, key, value, md.block_tables, tiles, tiles.stride(0),
                    out, hd**-0.5, q.stride(0), q.stride(1),
                    md.block_tables.stride(0), HEAD_DIM=hd, BLOCK_D=backend.block_d,
                    NUM_KV_HEADS=kvh, GROUP=backend.group, BLOCK_SIZE=bs, TILE_M=tm,
                    TILE_N=tn, PRECISION=None, DOT_F32=False, num_warps=warps,
                    num_stages=stages)

            try:
                t = graph_time(launch)
            except Exception as e:  # out of shared memory, say
                print(f"prefill {n} tm={tm} tn={tn} warps={warps} stages={stages}: "
                      f"{type(e).__name__}")
                continue
            rows.append({"prompt": n, "tile_m": tm, "tile_n": tn, "warps": warps,
                         "stages": stages, "s": t, "sdpa_s": sdpa,
                         "fraction_of_floor": flops / rate / t})
        mine = [r for r in rows if r["prompt"] == n]
        best = min(mine, key=lambda r: r["s"])
        cur = next((r for r in mine if (r["tile_m"], r["tile_n"], r["warps"], r["stages"]) == (
            at.PREFILL_TILE_M, at.PREFILL_TILE_N, at.PREFILL_WARPS, at.PREFILL_STAGES)), None)
        print(f"prefill {n:5d}: sdpa " + (f"{sdpa * 1e6:7.1f} us" if sdpa else "-")
              + "; current "
              + (f"{cur['s'] * 1e6:7.1f} us" if cur else "-")
              + f"; best tm={best['tile_m']} tn={best['tile_n']} warps={best['warps']} "
              f"stages={best['stages']} {best['s'] * 1e6:7.1f} us "
              f"({100 * best['fraction_of_floor']:.0f}% of the matmul rate)", flush=True)
    return rows


if __name__ == "__main__":
    main()
