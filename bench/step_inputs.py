"""How long the host takes to turn a decode plan into a step's inputs.

Before a forward pass the runner flattens the plan's chunks (`_prepare`),
makes the step's tensors and the attention backend's metadata
(`_forward_batch`) and, unless every sampled row is plain greedy
(`plain_greedy`), lists each sampled row's parameters (`_sample_requests`).
On a GPU this host work is what a decode step of a few milliseconds waits
on; on a CPU it is the part of a step that
is not the model's operators.  This times each part alone, without the
pass, for decode plans of `--batches` sequences, each over its own
`--context`-token context in blocks scattered over the cache (as a served
pool hands them out):

    python -m bench.step_inputs --batches 1,32,128 --context 512 --out step_inputs.json

Writes the median microseconds of each part per batch size.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import machine_meta, write_report
from engine.runner import ModelRunner
from engine.runner_prepare import plain_greedy
from engine.sampling_params import SamplingParams
from scheduler.plan import Plan, ScheduledChunk

PARTS = ("prepare", "forward_batch", "sample_requests")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", type=_ints, default=[1, 32, 128])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=300, help="timed repetitions per batch size")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--deterministic", choices=("auto", "on", "off"), default="auto",
                   help="the runner's deterministic mode (its attention metadata differs); "
                        "auto: as an Engine replica decides it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def decode_plan(runner: ModelRunner, batch: int, context: int, rng: random.Random,
                blocks: list[int]) -> Plan:
    """`batch` requests added to `runner`, each a `context - 1`-token prompt
    and one sampled output, which the plan feeds (a decode: a one-token
    chunk past the prompt that samples the next), each over its own blocks
    taken from `blocks` in their order.  A chunk holding the prompt's last
    token instead would take a deterministic runner's prompt path."""
    bs = runner.kv_cache.block_size
    need = -(-context // bs)
    chunks = []
    for i in range(batch):
        job = f"bench-{batch}-{i}"
        prompt = [rng.randrange(256, 4096) for _ in range(context - 1)]
        runner.add_request(job, SamplingParams(max_tokens=16, temperature=0.0), prompt)
        output = rng.randrange(256, 4096)
        runner._requests[job].output_token_ids.append(output)
        table = blocks[i * need:(i + 1) * need]
        chunks.append(ScheduledChunk(job, [output], context - 1, table, True, 1))
    return Plan(step=0, chunks=chunks)


def time_parts(runner: ModelRunner, plan: Plan, reps: int, warmup: int) -> dict[str, float]:
    """Median µs of each part over `reps` repetitions after `warmup`."""
    times: dict[str, list[float]] = {k: [] for k in PARTS}
    clock = time.perf_counter
    with torch.inference_mode():
        for i in range(warmup + reps):
            t0 = clock()
            prepared = runner._prepare(plan)
            t1 = clock()
            runner._forward_batch(prepared)
            t2 = clock()
            if not plain_greedy(prepared.sampled):
                runner._sample_requests(prepared.sampled)
            t3 = clock()
            if i >= warmup:
                for k, t in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2)):
                    times[k].append(t)
    return {k: round(1e6 * statistics.median(v), 1) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    torch.set_num_threads(1)
    bs = a.block_size
    num_blocks = sum(a.batches) * -(-a.context // bs) + 16
    runner = ModelRunner(a.model, a.dtype, "cpu", num_blocks=num_blocks, block_size=bs,
                         max_model_len=a.context + bs,
                         deterministic={"on": True, "off": False}.get(a.deterministic, "auto"))
    rng = random.Random(a.seed)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    rows = []
    for batch in a.batches:
        plan = decode_plan(runner, batch, a.context, rng, blocks)
        parts = time_parts(runner, plan, a.reps, a.warmup)
        total = sum(parts.values())
        rows.append({"batch": batch, **parts, "total_us": round(total, 1),
                     "us_per_sequence": round(total / batch, 2)})
        print(f"batch {batch:4d}: " + "  ".join(f"{k} {v:8.1f} µs" for k, v in parts.items())
              + f"  ({total / batch:.2f} µs a sequence)")
        for c in plan.chunks:
            runner.remove_request(c.job_id)
    args = sys.argv[1:] if argv is None else argv
    doc = {"command": "python -m bench.step_inputs " + " ".join(args),
           "machine": machine_meta(), "model": a.model, "dtype": a.dtype,
           "context": a.context, "block_size": bs, "deterministic": runner.attn.deterministic,
           "attention": type(runner.attn).__name__, "reps": a.reps, "rows": rows}
    write_report(doc, a.out)
    return doc


if __name__ == "__main__":
    main()
