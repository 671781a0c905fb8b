"""bf16 prompts' weighted sums of the values on VDPBF16PS, two keys an
instruction, against float32 FMAs key by key (engine/csrc/
paged_prefill_avx512.h, `weighted_sum_pairs`; switched in one process by
`preempt_serve::set_prefill_value_pairs`), one CPU thread, each pair of
ways alternated round by round (medians of `--rounds`).  On a CPU with AMX
the same switch sets how the tiles take p (paged_prefill_amx.h): one bf16
term ("pairs" below) or two ("fma"):

- the attention alone, one layer of SmolLM2's shape (9 query heads, 3 KV
  heads, head dim 64, blocks of 16 at random places in a cache four times
  the context): a whole prompt of each `--lens` length from position 0, and
  512 tokens after 1,024 cached; with each way's error against float64
  attention up to 2,048 tokens (the median of |got - ref| / (|ref| + 1e-3),
  the largest |got - ref|);
- a whole bf16 prefill step of the engine (`bench.engine_bench.OursBench`,
  greedy, lm_head and sampling included) for prompts of `--step-lens`.

    taskset -c 0 python -m studies.engine_cpu.prefill_value_pairs \\
        --out studies/engine_cpu/prefill_value_pairs_zen4.json
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


def _pairs(on: bool) -> bool:
    return bool(torch.ops.preempt_serve.set_prefill_value_pairs(on))


def _reference(q, keys, values, table, start: int) -> torch.Tensor:
    ctx, group = start + q.shape[0], HEADS // KV_HEADS
    k = keys[table].reshape(-1, KV_HEADS, DIM)[:ctx].double().repeat_interleave(group, 1)
    v = values[table].reshape(-1, KV_HEADS, DIM)[:ctx].double().repeat_interleave(group, 1)
    s = torch.einsum("thd,khd->htk", q.double(), k) * DIM**-0.5
    hidden = torch.arange(ctx)[None, :] > torch.arange(start, ctx)[:, None]
    return torch.einsum("htk,khd->thd", s.masked_fill(hidden, float("-inf")).softmax(-1), v)


def _attention_rows(lens: list[int], rounds: int) -> list[dict]:
    cpu = torch.device("cpu")
    ops = get_attention_backend("cpp")(HEADS, KV_HEADS, DIM, BS, cpu)
    assert ops.prefill_kernel is not None, "this build keeps prefills on SDPA"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for start, n in [(0, n) for n in lens] + [(1024, 512)]:
        ctx = start + n
        blocks = -(-ctx // BS)
        keys = torch.randn(4 * blocks, BS, KV_HEADS, DIM, generator=gen).bfloat16()
        values = torch.randn(4 * blocks, BS, KV_HEADS, DIM, generator=gen).bfloat16()
        table = torch.randperm(4 * blocks, generator=gen)[:blocks].tolist()
        q = torch.randn(n, HEADS, DIM, generator=gen).bfloat16()
        k = keys[table].reshape(-1, KV_HEADS, DIM)[start:ctx].clone()
        v = values[table].reshape(-1, KV_HEADS, DIM)[start:ctx].clone()
        md = ops.build_metadata([SeqSpan(start, n, table)])
        ref = _reference(q, keys, values, table, start) if ctx <= 2048 else None

        def run() -> torch.Tensor:
            return ops.forward(q, k, v, keys, values, md, DIM**-0.5)

        row: dict = {"start": start, "tokens": n}
        for way, on in (("fma", False), ("pairs", True)):
            _pairs(on)
            if ref is not None:
                err = (run().double() - ref).abs()
                rel = (err / (ref.abs() + 1e-3)).flatten()
                row[f"{way}_rel_err_median"] = round(rel.median().item(), 6)
                row[f"{way}_abs_err_max"] = round(err.max().item(), 5)
        reps = max(1, 2000 // n)
        times: dict[str, list[float]] = {"fma": [], "pairs": []}
        for _ in range(rounds):
            for way, on in (("fma", False), ("pairs", True)):
                _pairs(on)
                t = time.perf_counter()
                for _ in range(reps):
                    run()
                times[way].append((time.perf_counter() - t) / reps * 1e3)
        for way, ts in times.items():
            row[f"{way}_ms"] = round(statistics.median(ts), 3)
        row["speedup"] = round(row["fma_ms"] / row["pairs_ms"], 3)
        flops = 4 * HEADS * DIM * sum(start + i + 1 for i in range(n))
        row["pairs_gflops"] = round(flops / row["pairs_ms"] / 1e6, 1)
        row["fma_gflops"] = round(flops / row["fma_ms"] / 1e6, 1)
        rows.append(row)
        print(row)
    return rows


def _step_rows(lens: list[int], rounds: int) -> list[dict]:
    ea = engine_args(["--prefill-lens", ",".join(map(str, lens)), "--decode-batches", "1",
                      "--decode-steps", "1", "--warmup", "0", "--threads", "1", "--no-hf"])
    bench = OursBench(ea, "bfloat16")
    rows = []
    for n in lens:
        prompt = [(7 * i + 100) % 40000 + 100 for i in range(n)]
        times: dict[str, list[float]] = {"fma": [], "pairs": []}
        for r in range(rounds + 1):
            for way, on in (("fma", False), ("pairs", True)):
                _pairs(on)
                t = time.perf_counter()
                bench.prefill(prompt)
                if r:  # the first round warms up
                    times[way].append((time.perf_counter() - t) * 1e3)
        row = {"tokens": n, **{f"{w}_ms": round(statistics.median(ts), 1)
                               for w, ts in times.items()}}
        row["speedup"] = round(row["fma_ms"] / row["pairs_ms"], 3)
        rows.append(row)
        print(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="128,512,1024,2048,4096")
    ap.add_argument("--step-lens", default="128,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cpp.load_kernel()
    if not _pairs(True):
        raise SystemExit("needs the operators' AVX512-BF16 build")
    try:
        attention = _attention_rows([int(x) for x in a.lens.split(",")], a.rounds)
        steps = _step_rows([int(x) for x in a.step_lens.split(",")], a.rounds)
    finally:
        _pairs(True)
    write_report({"meta": {**machine_meta(), "rounds": a.rounds, "threads": 1,
                           "statistic": "median of the rounds"},
                  "attention": attention, "prefill_steps": steps}, a.out)


if __name__ == "__main__":
    main()
