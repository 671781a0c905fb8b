"""How long one `SchedulerCore.schedule()` takes with many queued jobs.

On a GPU a decode step lasts a few milliseconds, so planning the next
iteration must take far less (the target: ≤ 200 µs with 1,000 queued jobs,
and growth well below linear in the queue).  This drives
the real scheduler core with an instant engine, on a virtual clock, and
times `schedule()` alone:

- a steady state of `--queued` jobs: each one that finishes is replaced by
  a new arrival, so the queue never drains;
- prompt and output lengths drawn uniformly (seeded), so jobs prefill in
  chunks, decode, get demoted, preempted and swapped as they would live;
- swap-ins land at once (a synchronous engine), every iteration lasts the
  cost model's time, so MLFQ quanta, demotion and ENST behave as live.

    python -m bench.plan_time --out studies/plan_time/plan_time.json \\
        --plot studies/plan_time/plan_time.png

Writes the median / P90 / P99 of the timed calls per (policy, queue size),
the median of `complete()` on the same plans, and the mean batch the plans
carried (a plan that schedules nothing is fast for the wrong reason).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from bench.report import machine_meta, write_report
from engine.gc_heap import serving_heap
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from scheduler.job import Job
from scheduler.plan import BlockOpKind, JobOutput, StepResult

# An iteration of a small model on a GPU: 5 ms + 20 µs per token.
_COST = LinearCost(base_s=0.005, prefill_per_token_s=2e-5, decode_per_seq_s=2e-5)


class PlanTimeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str
    queued: int
    max_batch_size: int = 64
    max_batch_tokens: int = 2048
    block_size: int = 16
    num_blocks: int = 4096
    host_kv_blocks: int = 16384
    swap_mode: str = "proactive"
    prefix_caching: bool = True
    max_model_len: int = 2048
    prompt_len: tuple[int, int] = (16, 1024)
    output_len: tuple[int, int] = (16, 512)
    warmup: int = 200
    steps: int = 1000
    seed: int = 0
    # "wall": perf_counter; "cpu": this thread's CPU time, which leaves out
    # the time other processes took the core (steadier A/B on a shared box).
    clock: str = "wall"
    # Blocks a second the host tier copies, as an engine reports it
    # (`StepResult.copy_rate`): what bounds a plan's proactive swap-ins.
    # None: not reported (the bound is then 1/8 of the device blocks).
    copy_rate: float | None = None
    # "python": Python's default garbage collector; "serving": as an Engine
    # replica runs its scheduler (engine/gc_heap.py): the heap before
    # the first arrival frozen, young collections every 3,000 allocations.
    gc: Literal["python", "serving"] = "python"


class PlanTime(BaseModel):
    model_config = ConfigDict(extra="forbid")

    config: PlanTimeConfig
    median_us: float
    p90_us: float
    p99_us: float
    mean_us: float
    mean_batch: float
    mean_waiting: float
    num_preemptions: int
    num_finished: int
    # Median µs of `SchedulerCore.complete()` on each timed plan (the
    # scheduler's other share of an iteration's host time).
    complete_median_us: float = 0.0
    # Tokens sampled per second of the virtual clock over the timed plans:
    # what the plans achieve (a policy that thrashes plans fast and serves
    # nothing shows here).
    tokens_per_s: float = 0.0
    # Mean blocks a timed plan copies out (SWAP_OUT) and back (SWAP_IN):
    # the per-block work that makes a plan with swaps cost more.
    swap_out_blocks: float = 0.0
    swap_in_blocks: float = 0.0


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _iteration_time(plan: Any) -> float:
    prefill = sum(c.num_tokens for c in plan.chunks if not c.is_decode)
    return _COST.batch_time(sum(1 for c in plan.chunks if c.is_decode), 0, prefill, 0)


def measure(cfg: PlanTimeConfig) -> PlanTime:
    with contextlib.ExitStack() as stack:
        return _measure(cfg, stack)


def _measure(cfg: PlanTimeConfig, stack: contextlib.ExitStack) -> PlanTime:
    rng = random.Random(cfg.seed)
    clock = _Clock()
    sc = SchedulerConfig(
        policy=cfg.policy, block_size=cfg.block_size, num_blocks=cfg.num_blocks,
        max_batch_size=cfg.max_batch_size, max_batch_tokens=cfg.max_batch_tokens,
        max_model_len=cfg.max_model_len, swap_mode=cfg.swap_mode,  # type: ignore[arg-type]
        host_kv_blocks=cfg.host_kv_blocks, prefix_caching=cfg.prefix_caching,
    )
    core = SchedulerCore(sc, clock, cost=_COST)
    if cfg.gc == "serving":  # as a replica once its scheduler is built
        stack.enter_context(serving_heap())
    counter = 0

    def arrive() -> None:
        nonlocal counter
        p = rng.randint(*cfg.prompt_len)
        o = min(rng.randint(*cfg.output_len), cfg.max_model_len - p - 1)
        # Distinct prompts: no job finds another's blocks cached.
        core.add(Job(job_id=f"j{counter}", prompt_token_ids=[10_000 + counter] + [7] * (p - 1),
                     max_tokens=max(1, o), arrival_time=clock.t))
        counter += 1

    for _ in range(cfg.queued):
        arrive()
    times: list[float] = []
    completes: list[float] = []
    batches: list[int] = []
    waiting: list[int] = []
    sampled = 0
    blocks_out = blocks_in = 0
    t_start = 0.0
    gc.collect()
    tick = time.thread_time_ns if cfg.clock == "cpu" else time.perf_counter_ns
    for step in range(cfg.warmup + cfg.steps):
        t0 = tick()
        plan = core.schedule()
        dt = tick() - t0
        if step == cfg.warmup:
            t_start = clock.t
        if step >= cfg.warmup:
            times.append(dt / 1000)
            batches.append(len(plan.chunks))
            waiting.append(core.stats().num_waiting)
            sampled += sum(1 for c in plan.chunks if c.sample)
            blocks_out += sum(op.num_blocks for op in plan.block_ops
                              if op.kind is BlockOpKind.SWAP_OUT)
            blocks_in += sum(op.num_blocks for op in plan.block_ops
                             if op.kind is BlockOpKind.SWAP_IN)
        swapped_in = sorted({op.job_id for op in plan.block_ops
                             if op.kind is BlockOpKind.SWAP_IN})
        outputs = [JobOutput(c.job_id, 11 if c.sample else None) for c in plan.chunks]
        it = _iteration_time(plan)
        clock.t += it
        before = len(core.jobs)
        t0 = tick()
        core.complete(plan, StepResult(plan.step, outputs, it, swaps_in_done=swapped_in,
                                       copy_rate=cfg.copy_rate))
        if step >= cfg.warmup:
            completes.append((tick() - t0) / 1000)
        for _ in range(before - len(core.jobs)):
            arrive()
    times.sort()
    q = statistics.quantiles(times, n=100)
    return PlanTime(
        config=cfg, median_us=statistics.median(times), p90_us=q[89], p99_us=q[98],
        mean_us=statistics.fmean(times), mean_batch=statistics.fmean(batches),
        mean_waiting=statistics.fmean(waiting), num_preemptions=core.num_preemptions,
        num_finished=core.num_finished, complete_median_us=statistics.median(completes),
        tokens_per_s=sampled / max(clock.t - t_start, 1e-9),
        swap_out_blocks=blocks_out / len(times), swap_in_blocks=blocks_in / len(times))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.plan_time", description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="mlfq,fcfs")
    p.add_argument("--queued", type=_ints, default=[100, 1000, 5000])
    p.add_argument("--steps", type=int, default=1000, help="timed schedule() calls per point")
    p.add_argument("--warmup", type=int, default=200,
                   help="plans before the timed ones; a large pool fills only after several "
                        "hundred (2,000 at 16,384 blocks)")
    p.add_argument("--swap-mode", default="proactive",
                   choices=["recompute", "reactive", "proactive"])
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="plan without the prefix cache's bookkeeping")
    defaults = PlanTimeConfig.model_fields
    p.add_argument("--num-blocks", type=int, default=defaults["num_blocks"].default,
                   help="device KV blocks")
    p.add_argument("--host-kv-blocks", type=int,
                   default=defaults["host_kv_blocks"].default)
    p.add_argument("--copy-rate", type=float, default=None,
                   help="KV blocks a second the host tier copies, as an engine would report "
                        "it (bounds proactive swap-ins per iteration); default: not reported")
    p.add_argument("--gc", choices=["python", "serving"], default="python",
                   help="Python's default garbage collector, or the Engine replica's (its "
                        "start-up heap frozen, young collections every 3,000 allocations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time, or this thread's CPU time (steadier on a shared machine)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    return p.parse_args(argv)


def _plot(points: list[PlanTime], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(p.config.policy for p in points):
        mine = [p for p in points if p.config.policy == policy]
        xs = [p.config.queued for p in mine]
        ax.plot(xs, [p.median_us for p in mine], marker="o", label=f"{policy} median")
        ax.plot(xs, [p.p99_us for p in mine], marker="x", linestyle="--", label=f"{policy} P99")
    ax.axhline(200, color="grey", linewidth=0.8, linestyle=":", label="200 µs target")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("jobs in the scheduler")
    ax.set_ylabel("schedule() time (µs)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    points: list[PlanTime] = []
    t0 = time.time()
    for policy in a.policies.split(","):
        for n in a.queued:
            r = measure(PlanTimeConfig(policy=policy, queued=n, steps=a.steps,
                                       warmup=a.warmup, swap_mode=a.swap_mode, seed=a.seed,
                                       prefix_caching=not a.no_prefix_caching,
                                       clock=a.clock, num_blocks=a.num_blocks,
                                       host_kv_blocks=a.host_kv_blocks,
                                       copy_rate=a.copy_rate, gc=a.gc))
            points.append(r)
            print(f"{policy:>6} queued {n:>6}: median {r.median_us:8.1f} µs  "
                  f"P90 {r.p90_us:8.1f}  P99 {r.p99_us:8.1f}  batch {r.mean_batch:5.1f}  "
                  f"waiting {r.mean_waiting:7.1f}  preemptions {r.num_preemptions}  "
                  f"tokens/s {r.tokens_per_s:7.0f}  "
                  f"complete median {r.complete_median_us:6.1f} µs  "
                  f"swapped out / in {r.swap_out_blocks:5.1f} / {r.swap_in_blocks:5.1f} blocks",
                  flush=True)
    meta = {**machine_meta(), "processor": platform.processor(),
            "wall_s": round(time.time() - t0, 1), "cost_model": _COST.__dict__}
    write_report({"meta": meta, "results": [p.model_dump(mode="json") for p in points]}, a.out)
    if a.plot:
        _plot(points, a.plot)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
