"""CPU decode attention kernels side by side, against a memory-read floor.

One layer of decode attention for SmolLM2's head layout (9 query heads,
3 KV heads, dim 64), block size 16, blocks scattered over a 4,096-block
float32 cache, one thread.  Columns: the Inductor kernel padded to the
batch's longest table (as it was before its ragged work list), the
Inductor kernel over the ragged list (`engine/attention_compiled.py`), the
C++ operator (`engine/attention_cpp.py`), and the time one core takes to
stream the same number of KV bytes from one contiguous tensor (`floor`).
Each repetition runs every variant once, in turn, so that a noisy host
slows them alike; the figure is the median.

    python -m studies.engine_cpu.ragged_attention --out studies/engine_cpu/ragged_attention.json
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from bench.report import machine_meta, write_report
from bench.sampling_bench import _median_ms
from engine.attention import SeqSpan
from engine.attention_compiled import CompiledAttentionBackend, ragged_decode_attention
from engine.attention_cpp import CppAttentionBackend
from engine.attention_torch import TorchAttentionBackend

HEADS, KV_HEADS, DIM, BS, BLOCKS = 9, 3, 64, 16, 4096


def padded_decode_attention(q: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    n, width = block_tables.shape
    _, block_size, kv_heads, dim = key_cache.shape
    group = q.shape[1] // kv_heads
    k = key_cache[block_tables].float()
    v = value_cache[block_tables].float()
    qf = q.float().view(n, 1, 1, kv_heads, group, dim) * scale
    scores = (qf * k.unsqueeze(-2)).sum(-1).view(n, width * block_size, kv_heads, group)
    pos = torch.arange(width * block_size, device=q.device)
    beyond = (pos[None, :] >= context_lens[:, None])[:, :, None, None]
    scores = scores.masked_fill(beyond, float("-inf"))
    p = (scores - scores.amax(1, keepdim=True)).exp()
    weighted = (p.view(n, width, block_size, kv_heads, group, 1) * v.unsqueeze(-2)).sum((1, 2))
    return (weighted / p.sum(1)[..., None]).view(n, kv_heads * group, dim).to(q.dtype)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(BLOCKS, BS, KV_HEADS, DIM, generator=gen)
    values = torch.randn(BLOCKS, BS, KV_HEADS, DIM, generator=gen)
    cases = {
        "b32 all 768": [768] * 32,
        "b96 50-400 + one 1100": [rng.randint(50, 400) for _ in range(95)] + [1100],
        "b64 50-900": [rng.randint(50, 900) for _ in range(64)],
        "b8 20-300": [rng.randint(20, 300) for _ in range(8)],
    }
    padded = torch.compile(padded_decode_attention, dynamic=False, fullgraph=True)
    ragged = torch.compile(ragged_decode_attention, dynamic=False, fullgraph=True)
    cpu = torch.device("cpu")
    padded_md = TorchAttentionBackend(HEADS, KV_HEADS, DIM, BS, cpu).build_metadata
    ragged_md = CompiledAttentionBackend(HEADS, KV_HEADS, DIM, BS, cpu).build_metadata
    cpp_backend = CppAttentionBackend(HEADS, KV_HEADS, DIM, BS, cpu)
    assert cpp_backend.kernel is not None, "the C++ operator did not build here"
    rows = []
    for name, lens in cases.items():
        free = list(range(BLOCKS))
        rng.shuffle(free)
        spans = [SeqSpan(c - 1, 1, [free.pop() for _ in range(-(-c // BS))]) for c in lens]
        pm, rm = padded_md(spans), ragged_md(spans)
        q = torch.randn(len(lens), HEADS, DIM, generator=gen)
        p_args = (q, keys, values, pm.decode_block_tables, torch.tensor(lens))
        r_args = (q, keys, values, rm.decode_block_ids, rm.decode_block_seq, rm.decode_block_len)
        for t in (*p_args, *r_args):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(pm.decode_block_tables, 1)
        cm = cpp_backend.build_metadata(spans)
        c_args = (q, keys, values, cm.decode_block_ids, cm.decode_table_starts,
                  cm.decode_context_lens)
        kv_bytes = 2 * sum(lens) * KV_HEADS * DIM * keys.element_size()
        stream = torch.randn(kv_bytes // keys.element_size(), generator=gen)
        variants = {
            "padded": lambda: padded(*p_args, DIM**-0.5),
            "ragged": lambda: ragged(*r_args, DIM**-0.5),
            "cpp": lambda: cpp_backend.kernel(*c_args, DIM**-0.5),
            "floor": lambda: stream.sum(),
        }
        want = padded(*p_args, DIM**-0.5)
        diffs = {k: (variants[k]() - want).abs().max().item() for k in ("ragged", "cpp")}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.reps):
            for k, fn in variants.items():
                times[k].append(_median_ms(fn, 1))
        row = {"case": name, "batch": len(lens), "sum_context": sum(lens),
               "max_context": max(lens), "kv_mb": round(kv_bytes / 1e6, 1),
               **{f"{k}_ms": round(sorted(v)[len(v) // 2], 2) for k, v in times.items()},
               "max_abs_diff_vs_padded": diffs}
        rows.append(row)
        print(f"{name:<24} KV {row['kv_mb']:5.1f} MB  padded {row['padded_ms']:6.2f}  ragged "
              f"{row['ragged_ms']:6.2f}  cpp {row['cpp_ms']:6.2f}  floor {row['floor_ms']:5.2f} ms"
              f"  (max |diff| {max(diffs.values()):.1e})", flush=True)
    write_report({"meta": {"heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM, "block_size": BS,
                           "cache_blocks": BLOCKS, "dtype": "float32", "threads": 1,
                           **machine_meta()}, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
