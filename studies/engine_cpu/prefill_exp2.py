"""The AMX prefill's one-term probabilities with e^x as 2^(x log2 e) on a
degree-4 polynomial (`exp2_nonpositive16_for_bf16`, engine/csrc/kernel_util.h)
against the degree-7 `exp_nonpositive16` (switched in one process by
`preempt_serve::set_prefill_exp2`), one CPU thread, the two ways alternated,
in turn first (medians of `--rounds`):

- the prefill operator alone, one layer of SmolLM2's shape (9 query heads,
  3 KV heads, head dim 64, blocks of 16 at random places), a whole prompt
  of each `--lens` length from position 0, with how many outputs the two
  ways round differently and by how much at most;
- whole bf16 prefill steps of the engine in deterministic mode, the
  server's on CPU (`bench.engine_bench.OursBench`, greedy, lm_head and
  sampling included), of `--step-lens` tokens.

    taskset -c 0 python -m studies.engine_cpu.prefill_exp2 \\
        --out studies/engine_cpu/prefill_exp2_emr.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import engine.attention_cpp as cpp
from bench.engine_bench import OursBench
from bench.engine_bench import parse_args as engine_args
from bench.report import machine_meta, write_report
from engine.attention import SeqSpan, get_attention_backend
from studies.engine_cpu.alternate import switched, switched_prefills

HEADS, KV_HEADS, DIM, BS = 9, 3, 64, 16
WAYS = (("exp", False), ("exp2", True))


def _short_exp(on: bool) -> bool:
    return bool(torch.ops.preempt_serve.set_prefill_exp2(on))


def _op_rows(lens: list[int], rounds: int) -> list[dict]:
    cpu = torch.device("cpu")
    ops = get_attention_backend("cpp")(HEADS, KV_HEADS, DIM, BS, cpu)
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
        outs = {}
        for way, on in WAYS:
            _short_exp(on)
            outs[way] = ops.forward(q, k, v, keys, values, md, DIM**-0.5).float()
        diff = (outs["exp"] - outs["exp2"]).abs()
        reps = max(1, 4000 // n)

        def run() -> float:
            t = time.perf_counter()
            for _ in range(reps):
                ops.forward(q, k, v, keys, values, md, DIM**-0.5)
            return (time.perf_counter() - t) / reps * 1e3

        rows.append({"tokens": n, **switched(WAYS, _short_exp, run, rounds, warmup=1),
                     "outputs_differing": round((diff > 0).float().mean().item(), 4),
                     "max_abs_diff": diff.max().item()})
        print(rows[-1], flush=True)
    return rows


def _step_rows(lens: list[int], rounds: int) -> list[dict]:
    ea = engine_args(["--prefill-lens", ",".join(map(str, lens)), "--decode-batches", "1",
                      "--decode-steps", "1", "--warmup", "0", "--threads", "1", "--no-hf",
                      "--deterministic"])
    return switched_prefills(OursBench(ea, "bfloat16"), lens, WAYS, _short_exp, rounds)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="128,512,1024,2048")
    ap.add_argument("--step-lens", default="128,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cpp.load_kernel()
    if not _short_exp(True):
        raise SystemExit("needs the operators' AMX build")
    try:
        op = _op_rows([int(x) for x in a.lens.split(",")], a.rounds)
        steps = _step_rows([int(x) for x in a.step_lens.split(",")], a.rounds)
    finally:
        _short_exp(True)
    write_report({"meta": {**machine_meta(), "rounds": a.rounds, "threads": 1,
                           "statistic": "median of the rounds"},
                  "operator": op, "steps": steps}, a.out)


if __name__ == "__main__":
    main()
