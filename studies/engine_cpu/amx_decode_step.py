"""Whole decode steps with bf16 decodes on AMX tiles and on AVX512 vectors,
alternated in one process, on K/V spread over memory as a served batch's is.

`bench.engine_bench` decodes a batch that shares one prompt's blocks, so its
K/V stay in the CPU's caches; here every sequence gets its own copy of the
prompt's blocks at random places in a cache of `--batch` x `--context`
tokens (hundreds of MB), so each step reads them from memory, as a server's
decode batch does.  Steps alternate between the operator's two paths
(`engine.attention_cpp.decode_amx`); the tokens are the same on both (the
copies hold the same K/V), so only the attention's path differs.  One
thread, pinned where the caller pins it.

    taskset -c 0 python -m studies.engine_cpu.amx_decode_step --batch 32,96 \\
        --context 512 --out studies/engine_cpu/amx_decode_step.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from bench.engine_bench import GREEDY, _ints
from bench.report import machine_meta, write_report
from engine.attention_cpp import decode_amx
from engine.runner import ModelRunner
from scheduler.plan import Plan, ScheduledChunk


def spread_batch(batch: int, context: int, steps: int, bs: int, seed: int,
                 layout: str = "auto") -> tuple[ModelRunner, list[str], list[list[int]], int]:
    """A bf16 SmolLM2 runner holding `batch` decoding sequences of `context`
    tokens, each on its own copy of one prompt's blocks at random places,
    with room for `steps` more tokens: (runner, job ids, block tables, the
    first sampled token).  `layout`: its cache's (PREEMPT_SERVE_KV_LAYOUT,
    engine/kv_layout.py)."""
    per = context // bs
    own = -(-(steps + 2) // bs)
    num_blocks = per + batch * (per + own)
    saved = os.environ.get("PREEMPT_SERVE_KV_LAYOUT")
    os.environ["PREEMPT_SERVE_KV_LAYOUT"] = layout
    try:
        runner = ModelRunner("embedded:smollm2", dtype="bfloat16", device="cpu",
                             num_blocks=num_blocks, block_size=bs,
                             max_model_len=context + steps + 2, num_threads=1)
    finally:
        if saved is None:
            os.environ.pop("PREEMPT_SERVE_KV_LAYOUT")
        else:
            os.environ["PREEMPT_SERVE_KV_LAYOUT"] = saved
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 20000, (context,), generator=gen).tolist()
    runner.add_request("p", GREEDY, prompt)
    res = runner.execute(Plan(0, [ScheduledChunk("p", prompt, 0, list(range(per)), True, 0)]))
    first = res.outputs[0].token_id
    assert first is not None
    runner.remove_request("p")
    # Each sequence's blocks: a copy of the prompt's at random places.
    free = (torch.randperm(num_blocks - per, generator=gen) + per).tolist()
    tables = []
    cache = runner.kv_cache
    for _ in range(batch):
        table = [free.pop() for _ in range(per + own)]
        for layer in range(runner.model.num_layers):
            for t in (cache.key(layer), cache.value(layer)):
                t[table[:per]] = t[:per].clone()
        tables.append(table)
    jobs = [f"s{i}" for i in range(batch)]
    for job in jobs:
        runner.add_request(job, GREEDY, prompt, output_token_ids=[first])
    return runner, jobs, tables, first


def _steps(batch: int, context: int, steps: int, bs: int, seed: int) -> dict[str, object]:
    # Rows: the layout both paths read (a tiles cache is read by AMX only).
    runner, jobs, tables, first = spread_batch(batch, context, steps, bs, seed, layout="rows")
    last = [first] * batch
    times: dict[str, list[float]] = {"amx": [], "vectors": []}
    for step in range(steps):
        path = "amx" if step % 2 == 0 else "vectors"
        decode_amx(path == "amx")
        chunks = [ScheduledChunk(job, [tok], context + step, table, True, step + 1)
                  for job, tok, table in zip(jobs, last, tables)]
        t0 = time.perf_counter()
        res = runner.execute(Plan(step, chunks))
        times[path].append(time.perf_counter() - t0)
        last = [o.token_id for o in res.outputs]  # type: ignore[misc]
    decode_amx(True)
    # The first step of each path warms it up.
    amx, vec = statistics.median(times["amx"][1:]), statistics.median(times["vectors"][1:])
    row = {"batch": batch, "context": context, "steps_each": steps // 2 - 1,
           "amx_ms": round(amx * 1e3, 2), "vectors_ms": round(vec * 1e3, 2),
           "amx_tok_s": round(batch / amx, 1), "vectors_tok_s": round(batch / vec, 1),
           "speedup": round(vec / amx, 3)}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.engine_cpu.amx_decode_step",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=_ints, default=[32, 96])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12, help="decode steps, alternating paths")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not decode_amx(True):
        raise SystemExit("this build has no AMX path (no amx_tile/amx_bf16, or the OS refused)")
    rows = [_steps(b, a.context, a.steps, a.block_size, seed=b) for b in a.batch]
    meta = {"context": a.context, "steps": a.steps, "block_size": a.block_size, "threads": 1,
            "dtype": "bfloat16", **machine_meta()}
    write_report({"meta": meta, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
