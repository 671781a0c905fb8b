"""The AMX operators' one-term p with e^x as 2^(x log2 e) on a degree-4
polynomial (`exp2_nonpositive16_for_bf16`, engine/csrc/kernel_util.h)
against the degree-7 `exp_nonpositive16` (switched in one process by
`preempt_serve::set_short_exp`, for the prefill and the decode operator
alike), one CPU thread, the two ways alternated, in turn first (medians of
`--rounds`):

- the prefill operator alone, one layer of SmolLM2's shape (9 query heads,
  3 KV heads, head dim 64, blocks of 16 at random places), a whole prompt
  of each `--lens` length from position 0;
- the decode operator alone, the same shape, `--batch` sequences of each of
  `--contexts` tokens, K/V hot and cold (`decode_op.py`'s cases);
  each operator row with how many outputs the two ways round differently
  and by how much at most;
- whole bf16 steps of the engine in deterministic mode, the server's on
  CPU (`alternate.switched_steps`): prefills of `--step-lens` tokens,
  decode steps at `--batches` sequences of 128-token contexts.

    taskset -c 0 python -m studies.engine_cpu.short_exp \\
        --out studies/engine_cpu/short_exp_emr.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

import engine.attention_cpp as cpp
from bench.report import machine_meta, write_report
from engine.attention import SeqSpan, get_attention_backend
from studies.engine_cpu.alternate import switched, switched_steps
from studies.engine_cpu.decode_op import _case

HEADS, KV_HEADS, DIM, BS = 9, 3, 64, 16
WAYS = (("exp", False), ("exp2", True))


def _short_exp(on: bool) -> bool:
    return bool(torch.ops.preempt_serve.set_short_exp(on))


def _row(run: Callable[[], torch.Tensor], reps: int, rounds: int) -> dict:
    """`switched` over `reps` calls of `run`, with the two ways' outputs
    compared."""
    outs = {}
    for way, on in WAYS:
        _short_exp(on)
        outs[way] = run().float()
    diff = (outs["exp"] - outs["exp2"]).abs()

    def timed() -> float:
        t = time.perf_counter()
        for _ in range(reps):
            run()
        return (time.perf_counter() - t) / reps * 1e3

    return {**switched(WAYS, _short_exp, timed, rounds, warmup=1),
            "outputs_differing": round((diff > 0).float().mean().item(), 4),
            "max_abs_diff": diff.max().item()}


def _prefill_rows(lens: list[int], rounds: int) -> list[dict]:
    ops = get_attention_backend("cpp")(HEADS, KV_HEADS, DIM, BS, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lens:
        blocks = -(-n // BS)
        keys, values = (torch.randn(4 * blocks, BS, KV_HEADS, DIM, generator=gen).bfloat16()
                        for _ in range(2))
        table = torch.randperm(4 * blocks, generator=gen)[:blocks].tolist()
        q = torch.randn(n, HEADS, DIM, generator=gen).bfloat16()
        k, v = (torch.randn(n, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(2))
        md = ops.build_metadata([SeqSpan(0, n, table)])
        rows.append({"operator": "prefill", "tokens": n, **_row(
            lambda: ops.forward(q, k, v, keys, values, md, DIM**-0.5), max(1, 4000 // n),
            rounds)})
        print(rows[-1], flush=True)
    return rows


def _decode_rows(batch: int, contexts: list[int], rounds: int) -> list[dict]:
    rows = []
    for hot in (True, False):
        for ctx in contexts:
            args = _case(torch.bfloat16, batch, ctx, hot)
            rows.append({"operator": "decode", "kv": "hot" if hot else "cold", "batch": batch,
                         "context": ctx,
                         **_row(lambda: torch.ops.preempt_serve.paged_decode(*args), 5, rounds)})
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="128,512,1024,2048")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--contexts", default="128,1000")
    ap.add_argument("--step-lens", default="128,512,1024,2048")
    ap.add_argument("--batches", default="32,96")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cpp.load_kernel()
    if not (cpp.decode_amx(True) and _short_exp(True)):
        raise SystemExit("needs the operators' AMX build on a CPU with AMX")
    try:
        op = (_prefill_rows([int(x) for x in a.lens.split(",")], a.rounds)
              + _decode_rows(a.batch, [int(x) for x in a.contexts.split(",")], a.rounds))
        steps = switched_steps([int(x) for x in a.step_lens.split(",")],
                               [int(x) for x in a.batches.split(",")], WAYS, _short_exp,
                               a.rounds)
    finally:
        _short_exp(True)
    write_report({"meta": {**machine_meta(), "rounds": a.rounds, "threads": 1,
                           "statistic": "median of the rounds"},
                  "operators": op, "steps": steps}, a.out)


if __name__ == "__main__":
    main()
