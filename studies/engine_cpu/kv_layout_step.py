"""Whole bf16 decode steps and chunked prefills on a cache in the tiles
layout against one in rows (`engine/kv_layout.py`), at one or more block
sizes, alternated in one process, on K/V spread over memory as a served
batch's is.

One runner per variant (`--variants layout:block_size,...`), each built by
`amx_decode_step.spread_batch` (every sequence on its own copy of one
prompt's blocks at random places in a cache of hundreds of MB, so each
step reads its K/V from memory); steps go round the variants, and variants
that must agree bit for bit (the same block size, a multiple of 32, where
the tiles decode gives the rows decode's bits) must sample the same tokens
at every step.  Prefill: a `--context`-token prompt in two chunks (the
second reads the first's K/V back from the cache), round the variants
likewise.  One thread, pinned where the caller pins it.

    taskset -c 0 python -m studies.engine_cpu.kv_layout_step --batch 32,96 \\
        --context 512 --variants rows:16,tiles:16,tiles:32 \\
        --out studies/engine_cpu/kv_layout_step.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.engine_bench import GREEDY, _ints
from bench.report import machine_meta, write_report
from engine.attention_cpp import decode_amx
from scheduler.plan import Plan, ScheduledChunk
from studies.engine_cpu.amx_decode_step import spread_batch


def _variants(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        layout, bs = item.split(":")
        if layout not in ("rows", "tiles"):
            raise argparse.ArgumentTypeError(f"layout {layout!r}: rows or tiles")
        out.append((layout, int(bs)))
    return out


def _order(step: int, n: int) -> list[int]:
    # Each variant takes every place in the round in turn.
    return [(step + i) % n for i in range(n)]


def _steps(batch: int, context: int, steps: int, variants: list[tuple[str, int]],
           seed: int) -> dict[str, object]:
    runs = [spread_batch(batch, context, steps, bs, seed, layout=layout)
            for layout, bs in variants]
    for (layout, _), run in zip(variants, runs):
        assert run[0].kv_cache.layout == layout, "this CPU cannot hold a tiles cache"
    last = [[run[3]] * batch for run in runs]
    times: list[list[float]] = [[] for _ in variants]
    for step in range(steps):
        for v in _order(step, len(variants)):
            runner, jobs, tables, _ = runs[v]
            chunks = [ScheduledChunk(job, [tok], context + step, table, True, step + 1)
                      for job, tok, table in zip(jobs, last[v], tables)]
            t0 = time.perf_counter()
            res = runner.execute(Plan(step, chunks))
            times[v].append(time.perf_counter() - t0)
            last[v] = [o.token_id for o in res.outputs]  # type: ignore[misc]
        for a in range(len(variants)):
            for b in range(a):
                if variants[a][1] == variants[b][1] and variants[a][1] % 32 == 0:
                    assert last[a] == last[b], f"tokens differ at step {step}"
    row: dict[str, object] = {"batch": batch, "context": context, "steps_each": steps - 1}
    for (layout, bs), t in zip(variants, times):
        row[f"{layout}_{bs}_ms"] = round(statistics.median(t[1:]) * 1e3, 2)
    print(row, flush=True)
    return row


def _prefill(context: int, variants: list[tuple[str, int]], reps: int,
             seed: int) -> dict[str, object]:
    runs = [spread_batch(1, context, 2, bs, seed, layout=layout)[0] for layout, bs in variants]
    prompt = torch.randint(100, 20000, (context,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    half = context // 2
    times: list[list[float]] = [[] for _ in variants]
    for rep in range(reps):
        for v in _order(rep, len(variants)):
            runner = runs[v]
            table = list(range(-(-context // runner.block_size)))
            runner.add_request("p", GREEDY, prompt)
            t0 = time.perf_counter()
            runner.execute(Plan(0, [ScheduledChunk("p", prompt[:half], 0, table, False, 0)]))
            runner.execute(Plan(1, [ScheduledChunk("p", prompt[half:], half, table, True, 0)]))
            times[v].append(time.perf_counter() - t0)
            runner.remove_request("p")
    row: dict[str, object] = {"prefill": context, "chunks": 2, "reps_each": reps - 1}
    for (layout, bs), t in zip(variants, times):
        row[f"{layout}_{bs}_ms"] = round(statistics.median(t[1:]) * 1e3, 2)
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.engine_cpu.kv_layout_step",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=_ints, default=[32, 96])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="decode steps of each variant")
    ap.add_argument("--variants", type=_variants, default=_variants("rows:16,tiles:16,tiles:32"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not decode_amx(True):
        raise SystemExit("this build has no AMX path (no amx_tile/amx_bf16, or the OS refused)")
    rows = [_steps(b, a.context, a.steps, a.variants, seed=b) for b in a.batch]
    rows.append(_prefill(a.context, a.variants, 7, seed=1))
    meta = {"context": a.context, "steps": a.steps, "threads": 1, "dtype": "bfloat16",
            "variants": [f"{layout}:{bs}" for layout, bs in a.variants], **machine_meta()}
    write_report({"meta": meta, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
