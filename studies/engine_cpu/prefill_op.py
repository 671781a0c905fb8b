"""Prefill attention on CPU: the C++ prefill operator against SDPA.

Two measurements, one thread, each pair interleaved round by round so that a
noisy host slows both alike (medians of `--rounds`):

- the attention alone, one layer of SmolLM2's shape (9 query heads, 3 KV
  heads, head dim 64, blocks of 16 at random places): a whole prompt of
  each `--lens` length from position 0, and a later chunk of 512 tokens after
  1,024 cached ones (chunked prefill, or a recompute); "sdpa" is the torch
  backend's path (fresh K/V for a whole prompt; a gather of the blocks and
  an explicit mask for a later chunk), "operator" the C++ backend's;
- a whole prefill step of our engine (`bench.engine_bench.OursBench`,
  greedy, lm_head and sampling included) for prompts of the same lengths,
  with the backend's prefill operator on and off.

On a build with AMX, bf16 rows also time the operator with its products (the
scores, on VDPBF16PS, and the weighted sum) on the vectors instead of the
tiles (`operator_vectors_ms`, the same build switched by
`engine.attention_cpp.decode_amx`).

    python -m studies.engine_cpu.prefill_op --out studies/engine_cpu/prefill_op.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import engine.attention_cpp as cpp
from bench.engine_bench import OursBench
from bench.engine_bench import parse_args as engine_args
from bench.report import machine_meta, write_report
from engine.attention import SeqSpan, get_attention_backend

HEADS, KV_HEADS, DIM, BS = 9, 3, 64, 16


def _median_ms(fn, rounds: int, reps: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times) * 1e3


def _attention_rows(dtype: torch.dtype, lens: list[int], rounds: int) -> list[dict]:
    cpu = torch.device("cpu")
    ops = get_attention_backend("cpp")(HEADS, KV_HEADS, DIM, BS, cpu)
    ref = get_attention_backend("torch")(HEADS, KV_HEADS, DIM, BS, cpu)
    assert ops.prefill_kernel is not None, "this build keeps prefills on SDPA"
    gen = torch.Generator().manual_seed(0)
    cases = [(0, n) for n in lens] + [(1024, 512)]
    rows = []
    for start, n in cases:
        ctx = start + n
        blocks = -(-ctx // BS)
        # A cache four times the context, the sequence's blocks spread in it.
        keys = torch.randn(4 * blocks, BS, KV_HEADS, DIM, generator=gen).to(dtype)
        values = torch.randn(4 * blocks, BS, KV_HEADS, DIM, generator=gen).to(dtype)
        table = torch.randperm(4 * blocks, generator=gen)[:blocks].tolist()
        q = torch.randn(n, HEADS, DIM, generator=gen).to(dtype)
        k = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
        v = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
        spans = [SeqSpan(start, n, table)]
        md_ops, md_ref = ops.build_metadata(spans), ref.build_metadata(spans)
        got = ops.forward(q, k, v, keys, values, md_ops, DIM**-0.5)
        want = ref.forward(q, k, v, keys, values, md_ref, DIM**-0.5)
        err = (got.float() - want.float()).abs().max().item()
        reps = max(1, 2000 // n)
        op_ms, sdpa_ms, vec_ms = [], [], []
        tiles = dtype is torch.bfloat16 and cpp.decode_amx(True)
        for _ in range(rounds):
            op_ms.append(_median_ms(
                lambda: ops.forward(q, k, v, keys, values, md_ops, DIM**-0.5), 1, reps))
            sdpa_ms.append(_median_ms(
                lambda: ref.forward(q, k, v, keys, values, md_ref, DIM**-0.5), 1, reps))
            if tiles:
                cpp.decode_amx(False)
                try:
                    vec_ms.append(_median_ms(
                        lambda: ops.forward(q, k, v, keys, values, md_ops, DIM**-0.5), 1, reps))
                finally:
                    cpp.decode_amx(True)
        row = {"dtype": str(dtype).removeprefix("torch."), "start": start, "tokens": n,
               "operator_ms": round(statistics.median(op_ms), 3),
               "sdpa_ms": round(statistics.median(sdpa_ms), 3), "max_abs_diff": err}
        row["speedup"] = round(row["sdpa_ms"] / row["operator_ms"], 2)
        if vec_ms:
            row["operator_vectors_ms"] = round(statistics.median(vec_ms), 3)
            row["tiles_speedup"] = round(row["operator_vectors_ms"] / row["operator_ms"], 2)
        # Causal attention's multiplies (scores and weighted sum), per second.
        flops = 4 * HEADS * DIM * sum(start + i + 1 for i in range(n))
        row["operator_gflops"] = round(flops / row["operator_ms"] / 1e6, 1)
        rows.append(row)
        print(f"{row['dtype']:>9} attention start {start:4d} tokens {n:4d}: operator "
              f"{row['operator_ms']:7.3f} ms, sdpa {row['sdpa_ms']:7.3f} ms "
              f"({row['speedup']}x, {row['operator_gflops']} GFLOP/s)"
              + (f"; on vectors {row['operator_vectors_ms']:7.3f} ms" if vec_ms else ""))
    return rows


def _step_rows(dtype: str, lens: list[int], rounds: int) -> list[dict]:
    ea = engine_args(["--prefill-lens", ",".join(map(str, lens)), "--decode-batches", "1",
                      "--decode-steps", "1", "--warmup", "0", "--threads", "1", "--no-hf"])
    bench = OursBench(ea, dtype)
    backend = bench.runner.attn
    kernel = backend.prefill_kernel
    assert kernel is not None
    rows = []
    tiles = dtype == "bfloat16" and cpp.decode_amx(True)
    for n in lens:
        prompt = [(7 * i + 100) % 40000 + 100 for i in range(n)]
        on, off, vec = [], [], []
        ways = [(kernel, True, on), (None, True, off)] + ([(kernel, False, vec)] if tiles else [])
        try:
            for r in range(rounds + 1):
                for state, amx, times in ways:
                    backend.prefill_kernel = state
                    cpp.decode_amx(amx)
                    t = time.perf_counter()
                    bench.prefill(prompt)
                    if r:  # the first round warms up
                        times.append(time.perf_counter() - t)
        finally:
            backend.prefill_kernel = kernel
            cpp.decode_amx(True)
        row = {"dtype": dtype, "tokens": n,
               "operator_ms": round(statistics.median(on) * 1e3, 1),
               "sdpa_ms": round(statistics.median(off) * 1e3, 1)}
        row["speedup"] = round(row["sdpa_ms"] / row["operator_ms"], 3)
        if vec:
            row["operator_vectors_ms"] = round(statistics.median(vec) * 1e3, 1)
        rows.append(row)
        print(f"{dtype:>9} prefill step {n:4d} tokens: {row['operator_ms']:7.1f} ms with the "
              f"operator, {row['sdpa_ms']:7.1f} ms on SDPA ({row['speedup']}x)"
              + (f"; on vectors {row['operator_vectors_ms']:7.1f} ms" if vec else ""))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.engine_cpu.prefill_op",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--lens", default="32,128,512,1024,2048")
    ap.add_argument("--step-lens", default="128,512,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    lens = [int(x) for x in a.lens.split(",")]
    step_lens = [int(x) for x in a.step_lens.split(",")]
    attention, steps = [], []
    for dtype in a.dtypes.split(","):
        attention += _attention_rows(getattr(torch, dtype), lens, a.rounds)
        steps += _step_rows(dtype, step_lens, a.rounds)
    write_report({"meta": {"shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
                                     "block_size": BS},
                           "threads": 1, "rounds": a.rounds, **machine_meta()},
                  "attention": attention, "prefill_steps": steps}, a.out)


if __name__ == "__main__":
    main()
