"""A served burst replayed through the scheduler on a virtual clock.

Takes a live run's requests (a `bench run --save-records` JSON: when each was sent, its
prompt and output lengths) and the replica's timed iteration cost (`Engine.stats()`'s
`engine.iteration_cost`, as the triple scripts save it beside the run), and steps the real
`SchedulerCore` through them with the served configuration's limits: one iteration lasts
that cost's time for its batch, a decode row `--decode-row-s` on top (the timed fit has
none per row on CPU).  Prints when every request got its first token, so that a policy's
prefill order can be read without a server.

    python -m studies.burst.served \\
        studies/engine_cpu/vllm_cpu/ours_b128_bf16_zen4_2026-12-04b_2.json \\
        studies/engine_cpu/vllm_cpu/ours_b128_bf16_zen4_2026-12-04b_2_engine_stats.json \\
        --out studies/burst/served_zen4.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.metrics import Dist
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from scheduler.iteration import IterationDriver
from scheduler.job import Job
from studies.burst.run import _Clock, _Device

# serve_b128_bf16.yaml's limits.
_CONFIG = dict(policy="mlfq", block_size=16, num_blocks=65536 // 16, max_batch_size=128,
               max_batch_tokens=2048, max_model_len=2048, swap_mode="proactive",
               host_kv_blocks=32768 // 16)


def replica_cost(stats_path: Path) -> LinearCost:
    """The first engine replica's timed iteration cost."""
    engines = json.loads(stats_path.read_text())
    return LinearCost(**engines[0]["engine"]["iteration_cost"])


def replay(records: list[dict[str, Any]], cost: LinearCost, decode_row_s: float,
           **overrides: Any) -> dict[str, Any]:
    clock = _Clock()
    core = SchedulerCore(SchedulerConfig(**{**_CONFIG, **overrides}), clock, cost=cost)
    driver = IterationDriver(core, _Device(clock, cost, decode_row_s))
    pending = sorted(records, key=lambda r: r["send_time"])
    sent = {r["request_id"]: r["send_time"] for r in pending}
    first: dict[str, float] = {}
    i = 0
    while i < len(pending) or core.jobs:
        while i < len(pending) and pending[i]["send_time"] <= clock.t:
            r = pending[i]
            # A distinct first token: no prompt finds another's blocks cached.
            core.add(Job(job_id=r["request_id"],
                         prompt_token_ids=[10_000 + i] + [7] * (r["prompt_tokens"] - 1),
                         max_tokens=r["output_tokens"], arrival_time=clock.t))
            i += 1
        if not core.jobs:
            clock.t = pending[i]["send_time"]
            continue
        for it in driver.steps():
            for ev in it.events:
                first.setdefault(ev.job_id, clock.t)
        if len(first) == len(records):
            break  # every first token is out: the rest is decodes
    ttft = Dist.of(first[j] - sent[j] for j in first)
    prompt = {r["request_id"]: r["prompt_tokens"] for r in records}
    last = sorted(first, key=lambda j: first[j])[-5:]
    return {
        "ttft_mean_s": ttft.mean, "ttft_p50_s": ttft.median, "ttft_p99_s": ttft.p99,
        "ttft_max_s": ttft.max,
        "last_first_tokens": [{"request_id": j, "prompt_tokens": prompt[j],
                               "ttft_s": first[j] - sent[j]} for j in last],
        "demotions": core.policy.num_demotions if hasattr(core.policy, "num_demotions") else 0,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.burst.served",
                                description=__doc__.split("\n")[0])
    p.add_argument("records", type=Path)
    p.add_argument("engine_stats", type=Path)
    p.add_argument("--decode-row-s", type=float, default=0.0008,
                   help="a decode row's time beside the timed fit (Zen 4 SmolLM2: ~0.8 ms)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    records = json.loads(a.records.read_text())["records"]
    cost = replica_cost(a.engine_stats)
    rows = {}
    for policy in ("mlfq", "fcfs"):
        r = rows[policy] = replay(records, cost, a.decode_row_s, policy=policy)
        print(f"{policy:>5}: TTFT mean {r['ttft_mean_s']:.2f} s  P50 {r['ttft_p50_s']:.2f}  "
              f"P99 {r['ttft_p99_s']:.2f}  max {r['ttft_max_s']:.2f}  last: "
              + ", ".join(f"{x['prompt_tokens']} tokens at {x['ttft_s']:.2f}"
                          for x in r["last_first_tokens"]))
    if a.out:
        a.out.write_text(json.dumps({
            "command": "python -m studies.burst.served " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            "records": str(a.records), "cost": repr(cost), "decode_row_s": a.decode_row_s,
            "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
