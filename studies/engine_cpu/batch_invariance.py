"""Deterministic mode on CPU: what breaks batch invariance, whether the mode
fixes it, and what it costs.

Part 1 (`gemm`): rows of `F.linear` (MKL) multiplied alone vs among M rows,
untiled and in fixed tiles (`engine/models/batch_invariant.py`), 1 and 2
threads: how many rows come out with different bits.

Part 2 (`divergence`): SmolLM2 requests run one at a time vs all together
(chunked prefill, too few KV blocks, so jobs are preempted and recomputed),
greedy, in float32 and bfloat16, default vs deterministic mode: how many
requests' tokens differ, and from which token on.

Part 3 (`cost`): prefill and decode tokens/s of the default and the
deterministic engine (float32, one thread), measured alternately.

Part 4 (`tiles`, on request): the deterministic engine with GEMM tiles of
8, 16 and 32 rows, alternately: the choice of `TILE_ROWS`.

    python -m studies.engine_cpu.batch_invariance --out studies/engine_cpu/batch_invariance.json
    python -m studies.engine_cpu.batch_invariance --parts tiles --reps 3 \
        --out studies/engine_cpu/batch_invariance_tiles.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.report import machine_meta, write_report
from engine.models.batch_invariant import TiledLinear
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job
from studies.engine_cpu.alternate import alternate, engines

BS = 16


def gemm(rows: list[int]) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=gen) / 24
    x = torch.randn(max(rows) + 8, 576, generator=gen)
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, fn in (("untiled", F.linear), ("tiled", TiledLinear(F.linear))):
            alone = torch.cat([fn(x[i : i + 1], w) for i in range(x.shape[0])])
            differ = {}
            for m in rows:
                y = fn(x[3 : 3 + m], w)
                differ[m] = int((y != alone[3 : 3 + m]).any(dim=1).sum())
            out.append({"threads": threads, "linear": name, "rows_differing_by_m": differ})
            print(f"gemm threads={threads} {name}: {differ}", flush=True)
    torch.set_num_threads(1)
    return out


def _drive(runner: ModelRunner, prompts: dict[str, list[int]], params: SamplingParams,
           num_blocks: int, max_batch_tokens: int) -> tuple[dict[str, list[int]], int]:
    clock = iter(range(10**9))
    core = SchedulerCore(
        SchedulerConfig(policy="fcfs", block_size=BS, num_blocks=num_blocks, max_batch_size=32,
                        max_batch_tokens=max_batch_tokens, max_model_len=runner.max_model_len),
        clock=lambda: float(next(clock)),
    )
    tokens: dict[str, list[int]] = {}
    for j, p in prompts.items():
        assert params.max_tokens is not None
        core.add(Job(j, p, params.max_tokens, arrival_time=0.0))
        runner.add_request(j, params, p)
        tokens[j] = []
    while core.has_work:
        plan = core.schedule()
        for ev in core.complete(plan, runner.execute(plan)):
            assert ev.token_id is not None
            tokens[ev.job_id].append(ev.token_id)
            if ev.finished:
                runner.remove_request(ev.job_id)
    return tokens, core.num_preemptions


def divergence(model: str, n: int, new_tokens: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 200, (n,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    max_len = max(lengths) + new_tokens
    out = []
    for dtype in ("float32", "bfloat16"):
        for det in (False, True):
            runner = ModelRunner(model, dtype, "cpu", num_blocks=256, block_size=BS,
                                 max_model_len=max_len, num_threads=1, deterministic=det)
            vocab = min(runner.vocab_size, len(runner.tokenizer))
            pg = torch.Generator().manual_seed(2)
            prompts = {f"r{i}": torch.randint(100, vocab, (m,), generator=pg).tolist()
                       for i, m in enumerate(lengths)}
            t0 = time.perf_counter()
            alone = {j: _drive(runner, {j: p}, params, 256, 4096)[0][j]
                     for j, p in prompts.items()}
            # Room for about a third of the work at once: preemptions.
            blocks = max(-(-max_len // BS), sum(-(-(m + new_tokens) // BS) for m in lengths) // 3)
            together, preemptions = _drive(runner, prompts, params, blocks, 64)
            first = [next((k for k, (a, b) in enumerate(zip(alone[j], together[j])) if a != b),
                          None) for j in prompts]
            row = {"dtype": dtype, "deterministic": det, "requests": n,
                   "new_tokens": new_tokens, "preemptions": preemptions,
                   "requests_diverged": sum(f is not None for f in first),
                   "first_divergent_token": [f for f in first if f is not None],
                   "seconds": round(time.perf_counter() - t0, 1)}
            out.append(row)
            print(f"divergence {row}", flush=True)
    return out


def cost(model: str, prefill_lens: list[int], batches: list[int], reps: int,
         ) -> list[dict[str, Any]]:
    benches = engines(model, {"default": [], "deterministic": ["--deterministic"]},
                      prefill_lens, batches, reps)
    return alternate(benches, prefill_lens, batches, reps)


def tiles(model: str, sizes: list[int], prefill_lens: list[int], batches: list[int],
          reps: int) -> list[dict[str, Any]]:
    """The deterministic engine with GEMM tiles of each size, alternating."""
    benches = engines(model, {f"tile{t}": ["--deterministic"] for t in sizes},
                      prefill_lens, batches, reps)
    for t in sizes:
        model_ = benches[f"tile{t}"].runner.model
        for fn in (model_.linear, model_.head_linear):
            assert isinstance(fn, TiledLinear)
            fn.rows = t
    return alternate(benches, prefill_lens, batches, reps)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.engine_cpu.batch_invariance")
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--parts", default="gemm,divergence,cost",
                   help="comma-separated: gemm, divergence, cost, tiles")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    parts = {
        "gemm": lambda: gemm([1, 2, 3, 4, 5, 7, 9, 16, 33, 64, 100]),
        "divergence": lambda: divergence(args.model, args.requests, args.new_tokens),
        "cost": lambda: cost(args.model, [512, 2048], [1, 8, 32, 64], args.reps),
        "tiles": lambda: tiles(args.model, [8, 16, 32], [512, 2048], [1, 8, 32, 64], args.reps),
    }
    results = {name: parts[name]() for name in args.parts.split(",") if name}
    write_report({"meta": machine_meta(), "results": results}, args.out)


if __name__ == "__main__":
    main()
