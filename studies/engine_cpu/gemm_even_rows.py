"""Row blocks of even size in the bf16 GEMM (engine/csrc/gemm_bf16.cpp,
`even_blocks`): a row chunk of more than 8 rows cut as evenly as the
micro-kernel's 8 rows allow (9 as 5 + 4) against blocks of 8 and a tail
(8 + 1), switched in one process by `preempt_serve::set_gemm_even_rows`, one
CPU thread, the two ways alternated round by round (medians):

- SmolLM2's 120 projections (qkv, o, gate_up, down; 30 distinct copies of
  each, so that weights come from memory as in a step) at each of `--rows`;
- whole bf16 decode steps of the engine (`bench.engine_bench.OursBench`, each
  sequence on its own copy of a 128-token context) at each of `--batches`.

    taskset -c 0 python -m studies.engine_cpu.gemm_even_rows \\
        --out studies/engine_cpu/gemm_even_rows_zen4.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.engine_bench import OursBench
from bench.engine_bench import parse_args as engine_args
from bench.report import machine_meta, write_report
from engine import attention_cpp
from engine.models import packed_bf16

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
WAYS = (("tail", False), ("even", True))


def _even(on: bool) -> None:
    torch.ops.preempt_serve.set_gemm_even_rows(on)


def _projection_rows(rows: list[int], rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    ws = [(packed_bf16.pack((torch.randn(n, k, generator=gen) * 0.05).bfloat16()), k)
          for _ in range(30) for n, k in SHAPES]
    flops_per_row = sum(2 * n * k for n, k in SHAPES) * 30
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}
        results = {}
        for way, on in WAYS:
            _even(on)
            results[way] = [packed_bf16.linear(xs[k], w) for w, k in ws[:4]]
        same = all(torch.equal(a, b) for a, b in zip(results["tail"], results["even"]))
        times: dict[str, list[float]] = {w: [] for w, _ in WAYS}
        for _ in range(rounds + 1):
            for way, on in WAYS:
                _even(on)
                t = time.perf_counter()
                for w, k in ws:
                    packed_bf16.linear(xs[k], w)
                times[way].append(time.perf_counter() - t)
        med = {w: statistics.median(v[1:]) for w, v in times.items()}
        row = {"rows": m, "same_bits": same,
               **{f"{w}_gflops": round(flops_per_row * m / v / 1e9, 1) for w, v in med.items()},
               "speedup": round(med["tail"] / med["even"], 3)}
        out.append(row)
        print(row)
    return out


def _decode_rows(batches: list[int], rounds: int, steps: int) -> list[dict]:
    ea = engine_args(["--prefill-lens", "128", "--decode-batches", ",".join(map(str, batches)),
                      "--decode-context", "128", "--decode-steps", str((rounds + 1) * steps * 2),
                      "--warmup", "1", "--threads", "1", "--distinct-kv", "--no-hf"])
    bench = OursBench(ea, "bfloat16")
    prompt = [(7 * i + 100) % 40000 + 100 for i in range(128)]
    out = []
    for b in batches:
        step = bench.start_decode(prompt, b)
        step()
        times: dict[str, list[float]] = {w: [] for w, _ in WAYS}
        for r in range(rounds + 1):
            for way, on in WAYS:
                _even(on)
                ts = [step() for _ in range(steps)]
                if r:  # the first round warms up
                    times[way].append(statistics.median(ts))
        med = {w: statistics.median(v) * 1e3 for w, v in times.items()}
        row = {"batch": b, **{f"{w}_ms": round(v, 2) for w, v in med.items()},
               "speedup": round(med["tail"] / med["even"], 3)}
        out.append(row)
        print(row)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,9,10,11,12,16,17,18,19,24,25,33,40")
    ap.add_argument("--batches", default="8,9,10,11,12,16,17,18,24,25")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="decode steps a way takes per round")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    attention_cpp.load_kernel()
    if not packed_bf16.built():
        raise SystemExit("needs the operators' AVX512-BF16 build")
    try:
        gemm = _projection_rows([int(x) for x in a.rows.split(",")], a.rounds)
        decode = _decode_rows([int(x) for x in a.batches.split(",")], a.rounds, a.steps)
    finally:
        _even(True)
    write_report({"meta": {**machine_meta(), "rounds": a.rounds, "threads": 1,
                           "statistic": "median of the rounds"},
                  "projections": gemm, "decode_steps": decode}, a.out)


if __name__ == "__main__":
    main()
