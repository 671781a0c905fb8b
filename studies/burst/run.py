"""A burst larger than the KV tier, on a virtual clock.

The GPU study of the replica's serving loop (`studies/engine_gpu/engine_loop.py`, an H200,
random-weight Llama-3.2-1B shape) sent 2,000 requests at once to one replica and found the
MLFQ at a third of FCFS's throughput: each new job evicted started ones to recomputation,
which then did the same.  This replays that burst through the real `SchedulerCore` with the
iteration cost model that run measured (`engine_loop_fcfs.json`), the same request mix
(prompts 16–1,024 and answers 16–512 tokens, seed 0), KV cache (262,144 tokens), batch
limits (128 sequences, 4,096 tokens) and host tier (262,144 tokens in proactive mode), for
FCFS and the MLFQ with and without `mlfq.cold_start_recompute`.

    python -m studies.burst.run --out studies/burst/burst.json

Swap-ins land at the end of the iteration that issued them (no copy time is modelled), so
proactive mode's figures are an upper bound for it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
from pathlib import Path
from typing import Any

from scheduler.ahead import AheadDriver
from scheduler.config import MLFQConfig, SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.iteration import IterationDriver
from scheduler.cost import LinearCost
from scheduler.job import Job
from scheduler.plan import BlockOpKind, JobOutput, Plan, StepResult

_GPU_RUN = Path(__file__).parents[1] / "engine_gpu" / "engine_loop_fcfs.json"
BLOCK = 16


def measured_cost(path: Path = _GPU_RUN) -> LinearCost:
    """The cost model the GPU run fitted at start (stored as its repr)."""
    text = json.loads(path.read_text())["cost_model"]
    fields = dict(re.findall(r"(\w+)=([0-9.e+-]+)", text))
    return LinearCost(**{k: float(v) for k, v in fields.items()})


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Device:
    """An executor on the virtual clock: an iteration lasts the cost
    model's time for its batch (and `decode_row_s` per decode row on top),
    its swap-ins land with it."""

    def __init__(self, clock: _Clock, cost: LinearCost, decode_row_s: float = 0.0) -> None:
        self.clock, self.cost, self.decode_row_s = clock, cost, decode_row_s

    def launch(self, plan: Plan) -> StepResult:
        landed = sorted({op.job_id for op in plan.block_ops
                         if op.kind in (BlockOpKind.SWAP_IN, BlockOpKind.PREFETCH)})
        dt = (_iteration_time(plan, self.cost)
              + self.decode_row_s * sum(1 for c in plan.chunks if c.is_decode)
              if plan.chunks else 0.0)
        self.clock.t += dt
        return StepResult(
            plan.step, [JobOutput(c.job_id, 11 if c.sample else None) for c in plan.chunks],
            dt, swaps_in_done=landed)

    def collect(self, pending: StepResult) -> StepResult:
        return pending

    def execute(self, plan: Plan) -> StepResult:
        return self.launch(plan)

    def can_run_ahead(self, pending: StepResult, plan: Plan) -> bool:
        return True

    def remove_request(self, job_id: str) -> None:
        pass

    def wait_for_swaps(self, plan: Plan, result: StepResult) -> StepResult:
        return result


def run(policy: str, swap_mode: str, cold_start_recompute: bool, cost: LinearCost,
        requests: int = 2000, seed: int = 0, kv_tokens: int = 1 << 18,
        ahead: bool = False) -> dict[str, Any]:
    """`ahead`: each plan made while the previous one is in flight, as the
    replica does with `async_scheduling` (scheduler/ahead.py)."""
    clock = _Clock()
    host = kv_tokens // BLOCK if swap_mode != "recompute" else 0
    sc = SchedulerConfig(policy=policy, block_size=BLOCK, num_blocks=kv_tokens // BLOCK,
                         max_batch_size=128, max_batch_tokens=4096, max_model_len=2048,
                         swap_mode=swap_mode, host_kv_blocks=host,  # type: ignore[arg-type]
                         mlfq=MLFQConfig(cold_start_recompute=cold_start_recompute))
    core = SchedulerCore(sc, clock, cost=cost)
    rng = random.Random(seed)
    for i in range(requests):
        p = rng.randint(16, 1024)
        o = min(rng.randint(16, 512), 2048 - p - 1)
        core.add(Job(job_id=f"r{i}", prompt_token_ids=[7] * p, max_tokens=o, arrival_time=0.0))
    device = _Device(clock, cost)
    driver = AheadDriver(core, device) if ahead else IterationDriver(core, device)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens = iterations = 0
    while core.jobs or driver.in_flight is not None:
        for it in driver.steps() if core.jobs else driver.drain():
            iterations += 1
            for ev in it.events:
                tokens += 1
                first.setdefault(ev.job_id, clock.t)
                if ev.finished:
                    done[ev.job_id] = clock.t
    ttft = sorted(first.values())
    jct = sorted(done.values())
    return {
        "policy": policy, "swap_mode": swap_mode, "cold_start_recompute": cold_start_recompute,
        "ahead": ahead,
        "seconds": clock.t, "output_tokens_per_s": tokens / clock.t, "iterations": iterations,
        "preemptions": core.num_preemptions, "tokens_dropped": core.swap.tokens_dropped,
        "swap_outs": core.swap.num_swap_out,
        "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[int(0.99 * len(ttft))],
        "jct_mean_s": statistics.fmean(jct), "jct_p99_s": jct[int(0.99 * len(jct))],
        "finished": len(done)}


def _iteration_time(plan: Plan, cost: LinearCost) -> float:
    prefill = sum(c.num_tokens for c in plan.chunks if not c.is_decode)
    return cost.batch_time(sum(1 for c in plan.chunks if c.is_decode), 0, prefill, 0)


SYSTEMS = [("fcfs", "recompute", False), ("mlfq", "recompute", True), ("mlfq", "recompute", False),
           ("mlfq", "proactive", True), ("mlfq", "proactive", False)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.burst.run",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--ahead", action="store_true",
                   help="the systems of today's rule, each plan made with and without the "
                        "previous one in flight (async_scheduling)")
    a = p.parse_args(argv)
    cost = measured_cost()
    rows = []
    runs = [(s, False) for s in SYSTEMS] if not a.ahead else [
        (s, ahead) for s in SYSTEMS if not s[2] for ahead in (False, True)]
    for (policy, mode, old), ahead in runs:
        r = run(policy, mode, old, cost, a.requests, ahead=ahead)
        rows.append(r)
        print(f"{policy:>5} {mode:>9} cold_start_recompute={str(old):>5} ahead={ahead!s:>5}: "
              f"{r['iterations']:5d} iterations "
              f"{r['output_tokens_per_s']:8.0f} tok/s  TTFT P50/P99 {r['ttft_p50_s']:5.1f} / "
              f"{r['ttft_p99_s']:5.1f} s  JCT mean {r['jct_mean_s']:5.1f} s  "
              f"preemptions {r['preemptions']:6d}  tokens dropped {r['tokens_dropped']}",
              flush=True)
    command = "python -m studies.burst.run --out " + str(a.out) + (" --ahead" if a.ahead else "")
    a.out.write_text(json.dumps({"command": command,
                                 "cost_model": repr(cost), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
