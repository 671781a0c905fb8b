"""The decode operator on block tables that the scheduler's allocator really
hands out, with and without runs of consecutive blocks
(`scheduler/free_blocks.py`, `BlockManager(block_run=...)`).

Per set: a fresh pool of 4,096 blocks of 16 tokens (a 65,536-token cache,
the shipped CPU config's), 96 jobs whose prompts (64–256 tokens, drawn once)
are allocated one after the other, then all of them grow a token at a time
together to 512 tokens, as a decode batch does.  Each of 24 sets maps its
pool to its own part of one cache (1.2 GB), so that a repetition reads
K/V from DRAM, as in `decode_op_dram`.  The operator (AMX tiles where the
build has them) on those tables, `block_run` 1 (FIFO alone, what the
allocator did before runs) and 8, alternated; one thread.

    taskset -c 0 python -m studies.engine_cpu.block_runs --out studies/engine_cpu/block_runs.json

`--churn`: instead, the running jobs of a pool with turnover (`churned_tables`).
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch

from bench.report import machine_meta, write_report
from engine.attention_cpp import load_kernel
from scheduler.blocks import BlockManager, blocks_for
from scheduler.job import Job
from studies.engine_cpu.decode_op_dram import median_ms

BATCH, CONTEXT, BLOCK, POOL, HEADS, KV_HEADS, DIM, SETS = 96, 512, 16, 4096, 9, 3, 64, 24


def tables(block_run: int, prompts: list[int]) -> list[list[int]]:
    """The block tables of BATCH jobs after their prompts and a decode of
    all of them together up to CONTEXT tokens."""
    bm = BlockManager(POOL, BLOCK, block_run=block_run)
    jobs = [Job(job_id=f"j{i}", prompt_token_ids=[0] * p, max_tokens=CONTEXT, arrival_time=0.0)
            for i, p in enumerate(prompts)]
    for j in jobs:
        assert bm.grow(j, len(j.prompt_token_ids))
        j.num_computed_tokens = len(j.prompt_token_ids)
    for _ in range(CONTEXT - min(prompts)):
        for j in jobs:
            if j.num_computed_tokens < CONTEXT:
                assert bm.grow(j, 1)
                j.num_computed_tokens += 1
    return [j.block_table for j in jobs]


def churned_tables(block_run: int, steps: int = 3000) -> list[list[int]]:
    """The block tables of BATCH running jobs after `steps` decode steps of
    a pool with turnover: each job has a prompt of 64-256 tokens and an
    output of 50-600; when one finishes, a new one arrives and takes its
    prompt's blocks, so that freed blocks come back in the order jobs end,
    as in a server that has run for a while.  The same draws for every
    `block_run`."""
    rng = random.Random(1)
    bm = BlockManager(POOL, BLOCK, block_run=block_run)
    made = 0

    def new_job() -> tuple[Job, int]:
        nonlocal made
        made += 1
        p = rng.randint(64, 256)
        j = Job(job_id=f"j{made}", prompt_token_ids=[0] * p, max_tokens=600, arrival_time=0.0)
        assert bm.grow(j, p)
        j.num_computed_tokens = p
        return j, p + rng.randint(50, 600)

    running = [new_job() for _ in range(BATCH)]
    for _ in range(steps):
        for i, (j, end) in enumerate(running):
            if j.num_computed_tokens >= end:
                bm.free(j)
                running[i] = new_job()
            else:
                assert bm.grow(j, 1)
                j.num_computed_tokens += 1
    return [j.block_table[:blocks_for(j.num_computed_tokens, BLOCK)] for j, _ in running]


def mean_run(table: list[int]) -> float:
    breaks = sum(1 for a, b in zip(table, table[1:]) if b != a + 1)
    return len(table) / (breaks + 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="1,8", help="block_run values, alternated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--churn", action="store_true",
                    help="tables of a pool with turnover (churned_tables), contexts as they are")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    op = load_kernel()
    rng = random.Random(0)
    prompts = [rng.randint(64, 256) for _ in range(BATCH)]
    g = torch.Generator().manual_seed(0)
    k = torch.randn(SETS * POOL, BLOCK, KV_HEADS, DIM, generator=g).bfloat16()
    v = torch.randn(SETS * POOL, BLOCK, KV_HEADS, DIM, generator=g).bfloat16()
    q = torch.randn(BATCH, HEADS, DIM, generator=g).bfloat16()
    runs = [int(r) for r in args.runs.split(",")]
    cases = {}
    for r in runs:
        t = churned_tables(r) if args.churn else tables(r, prompts)
        flat = torch.tensor([b for tab in t for b in tab])
        sizes = torch.tensor([len(tab) for tab in t])
        starts = torch.cumsum(sizes, 0) - sizes
        # The last block full: the contexts of whole blocks.
        lens = sizes * BLOCK
        cases[r] = ([flat + s * POOL for s in range(SETS)],
                    statistics.mean(mean_run(tab) for tab in t), starts, lens)
    rows = []
    for rnd in range(args.rounds):
        for r in runs:
            sets, span, starts, lens = cases[r]
            ms = median_ms(op, q, k, v, sets, starts, lens)
            rows.append({"round": rnd, "block_run": r, "mean_run_blocks": span, "ms": ms})
            print(f"round {rnd} block_run {r}: blocks in runs of {span:.1f} on average, "
                  f"{ms:.2f} ms", flush=True)
    write_report({"kind": "block_runs", "meta": machine_meta(), "batch": BATCH,
                  "churn": args.churn, "context": None if args.churn else CONTEXT,
                  "block_size": BLOCK, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
