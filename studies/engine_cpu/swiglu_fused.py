"""SwiGLU's gate_up projection and silu(gate) × up in one pass on AMX tiles
(`preempt_serve::linear_bf16_codes_silu_mul`, engine/csrc/gemm_bf16_amx.h's
`gemm_swiglu`) against the projection then `silu_mul` (switched in one
process by `preempt_serve::set_swiglu_fused`; the same bits either way),
one CPU thread, the two ways alternated, in turn first (medians of
`--rounds`):

- the operator alone on SmolLM2's gate_up weight (2 × 1,536 columns, K 576,
  as GGUF codes with their bf16 values) at each of `--rows`;
- whole bf16 steps of the engine in deterministic mode, the server's on CPU
  (`bench.engine_bench.OursBench`, greedy, lm_head and sampling included):
  prefills of `--step-lens` tokens and decode steps at `--batches`
  sequences of 128-token contexts, each its own (past 64 rows the decode
  layer takes the fused pass too).

    taskset -c 0 python -m studies.engine_cpu.swiglu_fused \\
        --out studies/engine_cpu/swiglu_fused_emr.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import engine.attention_cpp as cpp
from bench.report import machine_meta, write_report
from engine.models import packed_bf16, weight_codes
from studies.engine_cpu.alternate import switched, switched_steps
from tests.engine.test_packed_f32_codes import _q4_1

HIDDEN, INTER = 576, 1536
WAYS = (("two_ops", False), ("fused", True))


def _fused(on: bool) -> bool:
    return bool(torch.ops.preempt_serve.set_swiglu_fused(on))


def _op_rows(rows_list: list[int], rounds: int) -> list[dict]:
    w = _q4_1(2 * INTER, HIDDEN, seed=1)
    codes = weight_codes.fit(w)
    assert codes is not None
    both = weight_codes.with_values(codes, packed_bf16.pack(w.bfloat16()))
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
        reps = max(2, 4000 // rows)

        def run() -> float:
            t = time.perf_counter()
            for _ in range(reps):
                torch.ops.preempt_serve.linear_bf16_codes_silu_mul(x, both, None)
            return (time.perf_counter() - t) / reps * 1e3

        out.append({"rows": rows, **switched(WAYS, _fused, run, rounds, warmup=1)})
        print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="96,128,512,1024,2048")
    ap.add_argument("--step-lens", default="128,512,1024,2048")
    ap.add_argument("--batches", default="96,128")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cpp.load_kernel()
    if not _fused(True):
        raise SystemExit("needs the operators' AMX build")
    try:
        op = _op_rows([int(x) for x in a.rows.split(",")], a.rounds)
        steps = switched_steps([int(x) for x in a.step_lens.split(",")],
                               [int(x) for x in a.batches.split(",")], WAYS, _fused, a.rounds)
    finally:
        _fused(True)
    write_report({"meta": {**machine_meta(), "rounds": a.rounds, "threads": 1,
                           "statistic": "median of the rounds"},
                  "operator": op, "steps": steps}, a.out)


if __name__ == "__main__":
    main()
