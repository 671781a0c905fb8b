"""AMX decodes' weighted sum with p in one bf16 term against two
(engine/csrc/paged_decode_amx.h; switched in one process by
`preempt_serve::set_decode_value_terms`), one CPU thread, the two ways
alternated, in turn first (medians of `--rounds`):

- the decode operator alone, one layer of SmolLM2's attention shape at
  `--batch` sequences of each of `--contexts` tokens, its K/V hot (every
  sequence reads the same blocks, which stay in the CPU's caches) and cold
  (blocks drawn from a cache eight times larger): `decode_op.py`'s cases;
  with the largest difference between the two ways' outputs;
- whole bf16 decode steps of the engine in deterministic mode, the server's
  on CPU (`bench.engine_bench.OursBench`, greedy), at `--batches` sequences
  of 256-token contexts, each its own.

    taskset -c 0 python -m studies.engine_cpu.decode_value_terms \\
        --out studies/engine_cpu/decode_value_terms_emr.json
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
from studies.engine_cpu.alternate import switched
from engine.attention_cpp import decode_amx, load_kernel
from studies.engine_cpu.decode_op import _case

WAYS = (("two", False), ("one", True))


def _one_term(on: bool) -> bool:
    return bool(torch.ops.preempt_serve.set_decode_value_terms(on))


def _op_rows(batch: int, contexts: list[int], rounds: int) -> list[dict]:
    rows = []
    for hot in (True, False):
        for ctx in contexts:
            args = _case(torch.bfloat16, batch, ctx, hot)

            def run() -> torch.Tensor:
                return torch.ops.preempt_serve.paged_decode(*args)

            outs = {}
            for way, on in WAYS:
                _one_term(on)
                outs[way] = run().float()

            def timed() -> float:
                t = time.perf_counter()
                for _ in range(5):
                    run()
                return (time.perf_counter() - t) / 5 * 1e3

            rows.append({"kv": "hot" if hot else "cold", "batch": batch, "context": ctx,
                         **switched(WAYS, _one_term, timed, rounds),
                         "max_abs_diff": round((outs["one"] - outs["two"]).abs().max().item(), 5)})
            print(rows[-1], flush=True)
    return rows


def _step_rows(batches: list[int], rounds: int) -> list[dict]:
    ea = engine_args(["--prefill-lens", "128", "--decode-batches", ",".join(map(str, batches)),
                      "--decode-context", "256", "--decode-steps", str(8 * rounds),
                      "--warmup", "0", "--threads", "1", "--no-hf", "--distinct-kv",
                      "--deterministic"])
    bench = OursBench(ea, "bfloat16")
    rows = []
    for b in batches:
        step = bench.start_decode([(5 * i + 300) % 40000 + 100 for i in range(256)], b)
        # Each round's figure: the median of 4 steps.
        rows.append({"batch": b, "context": 256, **switched(
            WAYS, _one_term, lambda: statistics.median(step() for _ in range(4)) * 1e3,
            rounds)})
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--contexts", default="128,300,1000")
    ap.add_argument("--batches", default="32,96")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    load_kernel()
    if not (decode_amx(True) and _one_term(True)):
        raise SystemExit("needs the operators' AMX build on a CPU with AMX")
    try:
        op = _op_rows(a.batch, [int(x) for x in a.contexts.split(",")], a.rounds)
        steps = _step_rows([int(x) for x in a.batches.split(",")], a.rounds)
    finally:
        _one_term(True)
    write_report({"meta": {**machine_meta(), "rounds": a.rounds, "threads": 1,
                           "statistic": "median of the rounds"},
                  "operator": op, "steps": steps}, a.out)


if __name__ == "__main__":
    main()
