"""A burst's prefills replayed on the engine alone: where the time to the
last first token goes.

Takes the prompt lengths of a served burst (a `bench run --save-records`
JSON, e.g. burst_policy.sh's), orders them shortest first (the skip-join
MLFQ's prefill order) or as sent (`--order sent`, FCFS's), and packs them
into iterations of at most `--budget` tokens, a prompt cut across two where
the budget runs out, as the server's chunked prefill does; the first prompt
alone (the server's first iteration starts on the first arrival). Each
iteration is one `ModelRunner.execute` on one thread with no server around
it, in the server's deterministic mode unless told, timed whole and split by
wrapping the model's calls with a clock (no profiler: on Zen 4 torch's
profiler doubles our GEMM's time): the four projections, attention, and the
rest (norms, rotation, SiLU × up, residuals, the lm_head of the rows that
sample, sampling, Python). `--busy-core N` keeps core N busy meanwhile with
the kind of work a server's other processes do (Python objects and JSON).

    taskset -c 0 python -m studies.engine_cpu.vllm_cpu.burst_replay \\
        studies/engine_cpu/vllm_cpu/burst_mlfq_2026-12-04_1.json \\
        --out studies/engine_cpu/vllm_cpu/burst_replay_zen4.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.engine_bench import GREEDY
from bench.report import machine_meta, write_report
from engine.runner import ModelRunner
from scheduler.plan import Plan, ScheduledChunk

BLOCK = 16
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# `--busy-core`: what a server's other processes do there (the proxy, the
# ingress, the client: Python objects and JSON), without end.
BUSY = """
import json, random
r = random.Random(0)
data = [{"id": i, "text": "x" * r.randrange(10, 400), "ids": list(range(r.randrange(5, 300)))}
        for i in range(20000)]
while True:
    json.loads(json.dumps(data))
"""


def pack(lens: list[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """Iterations of (prompt index, start, length) chunks: the first prompt
    alone, then each iteration filled to `budget` in order."""
    steps = [[(0, 0, lens[0])]]
    done = [0] * len(lens)
    i = 1
    while i < len(lens):
        step, left = [], budget
        while i < len(lens) and left > 0:
            n = min(left, lens[i] - done[i])
            step.append((i, done[i], n))
            done[i] += n
            left -= n
            if done[i] == lens[i]:
                i += 1
        steps.append(step)
    return steps


class Clock:
    """Seconds spent in the model's calls, by part, summed over a step."""

    def __init__(self, runner: ModelRunner) -> None:
        self.parts: Counter[str] = Counter()
        model = runner.model
        # A projection's part is its name (the call's third argument).
        model.project = self._timed(model.project, lambda a: a[2])
        model.attn.forward = self._timed(model.attn.forward, lambda a: "attention")

    def _timed(self, fn: Callable[..., Any],
               part: Callable[[tuple[Any, ...]], str]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = fn(*a, **k)
            self.parts[part(a)] += time.perf_counter() - t
            return out
        return call


def projection_flops(model: Any, tokens: int) -> float:
    """The four projections' multiply-adds × 2 for `tokens` tokens."""
    c = model.config
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    per_layer = c.hidden_size * (q + 2 * kv + q + 3 * c.intermediate_size)
    return 2.0 * tokens * model.num_layers * per_layer


def burst_lens(records: Path, order: str) -> list[int]:
    """The prompt lengths of a `--save-records` run, shortest first or as sent."""
    recs = json.loads(records.read_text())["records"]
    if order == "sent":
        recs = sorted(recs, key=lambda r: int(r["request_id"].rsplit("-", 1)[1]))
    lens = [r["prompt_tokens"] for r in recs]
    return sorted(lens) if order == "shortest" else lens


class Burst:
    """The burst's prompts on a fresh engine, ready to be prefilled again
    and again in `pack`'s iterations."""

    def __init__(self, lens: list[int], budget: int, threads: int, seed: int,
                 deterministic: bool | str) -> None:
        self.lens, self.steps = lens, pack(lens, budget)
        self.runner = ModelRunner("embedded:smollm2", dtype="bfloat16", device="cpu",
                                  num_blocks=sum(-(-n // BLOCK) for n in lens), block_size=BLOCK,
                                  max_model_len=2048, num_threads=threads,
                                  deterministic=deterministic)
        rng = random.Random(seed)
        self.prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in lens]
        self.tables, first = [], 0
        for n in lens:
            self.tables.append(list(range(first, first + -(-n // BLOCK))))
            first += len(self.tables[-1])

    def run(self, each: Callable[[int, float], None] = lambda s, t: None) -> float:
        """Prefill every prompt, iteration by iteration; `each(step, seconds)`
        after each; returns the seconds of all."""
        for i, p in enumerate(self.prompts):
            self.runner.add_request(f"p{i}", GREEDY, p)
        total = 0.0
        for s, step in enumerate(self.steps):
            chunks = [ScheduledChunk(f"p{i}", self.prompts[i][start:start + n], start,
                                     self.tables[i], start + n == self.lens[i], 0)
                      for i, start, n in step]
            t = time.perf_counter()
            self.runner.execute(Plan(s, chunks))
            dt = time.perf_counter() - t
            total += dt
            each(s, dt)
        for i in range(len(self.prompts)):
            self.runner.remove_request(f"p{i}")
        return total


def busy_core(core: int) -> subprocess.Popen[bytes]:
    """A process on `core` doing `BUSY` until killed."""
    return subprocess.Popen([sys.executable, "-c", BUSY],
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))


def replay(lens: list[int], budget: int, threads: int, seed: int,
           deterministic: bool | str) -> tuple[list[dict[str, Any]], bool, float]:
    burst = Burst(lens, budget, threads, seed, deterministic)
    clock = Clock(burst.runner)
    rows: list[dict[str, Any]] = []

    def record(s: int, total: float) -> None:
        step = burst.steps[s]
        proj = {p: clock.parts[p] * 1e3 for p in PROJECTIONS}
        rows.append({
            "step": s, "prompts": len(step), "tokens": sum(n for _, _, n in step),
            "first_tokens": sum(1 for i, start, n in step if start + n == lens[i]),
            "ms": round(total * 1e3, 1),
            "projections_ms": {p: round(v, 1) for p, v in proj.items()},
            "attention_ms": round(clock.parts["attention"] * 1e3, 1),
            "rest_ms": round((total - sum(clock.parts.values())) * 1e3, 1),
        })
        clock.parts.clear()
        print(rows[-1], flush=True)

    burst.run(record)
    return rows, burst.runner.deterministic, projection_flops(burst.runner.model, sum(lens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path, help="a bench run JSON with --save-records")
    ap.add_argument("--order", choices=("shortest", "sent"), default="shortest")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per iteration")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deterministic", choices=("auto", "on", "off"), default="auto",
                    help="the engine's mode; auto: the server's default")
    ap.add_argument("--busy-core", type=int,
                    help="keep this core busy with Python and JSON work meanwhile")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    lens = burst_lens(a.records, a.order)
    mode = {"auto": "auto", "on": True, "off": False}[a.deterministic]
    busy = None if a.busy_core is None else busy_core(a.busy_core)
    try:
        rows, deterministic, flops = replay(lens, a.budget, a.threads, a.seed, mode)
    finally:
        if busy is not None:
            busy.kill()
    s = sum(r["ms"] for r in rows)
    proj = sum(sum(r["projections_ms"].values()) for r in rows)
    summary = {"prompt_tokens": sum(lens), "iterations": len(rows), "total_s": round(s / 1e3, 2),
               # Zero where a decoder layer runs as one C++ operator (no
               # projection call of the model's to time): no split then.
               "projections_share": round(proj / s, 3) if proj else None,
               "projections_gflops": round(flops / proj / 1e6, 1) if proj else None,
               "attention_s": round(sum(r["attention_ms"] for r in rows) / 1e3, 2),
               "rest_s": round(sum(r["rest_ms"] for r in rows) / 1e3, 2)}
    print(summary)
    write_report({"meta": {**machine_meta(), "records": str(a.records), "order": a.order,
                           "budget": a.budget, "threads": a.threads,
                           "deterministic": deterministic, "busy_core": a.busy_core},
                  "summary": summary, "steps": rows}, a.out)


if __name__ == "__main__":
    main()
