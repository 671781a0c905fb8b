"""What the prefix cache does per plan in `bench.plan_time`'s regime: blocks
indexed (by the caller: `grow`, `free`, `complete`), blocks evicted, and
lookups and what they found, per plan over warm-up and timed plans alike.

    python studies/plan_time/index_counts.py [--queued 5000] [--num-blocks 65536] \
        [--host-kv-blocks 262144] [--warmup 3000] [--steps 1000] [--out F.json]

Counts by wrapping `PrefixCache`'s methods; a block indexed is one its job's
path gained, new when no identical block was indexed already.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

import scheduler.prefix_cache as pc
from bench import plan_time as pt


def count(cfg: pt.PlanTimeConfig) -> dict[str, float]:
    seen: collections.Counter[str] = collections.Counter()
    index, evict, peek = pc.PrefixCache.index, pc.PrefixCache.evict_many, pc.PrefixCache.peek

    def counted_index(self: pc.PrefixCache, job: Any, upto: int) -> None:
        before, version = len(self._paths.get(job.job_id, ())), self.version
        index(self, job, upto)
        caller = sys._getframe(1).f_code.co_name
        seen[f"index {caller} calls"] += 1
        seen[f"index {caller} blocks"] += len(self._paths.get(job.job_id, ())) - before
        seen[f"index {caller} new"] += self.version - version

    def counted_evict(self: pc.PrefixCache, n: int) -> list[int]:
        seen["evicted blocks"] += n
        return evict(self, n)

    def counted_peek(self: pc.PrefixCache, job: Any, at_most: int | None = None) -> Any:
        found = peek(self, job, at_most)
        caller = sys._getframe(1).f_code.co_name
        seen[f"peek {caller} calls"] += 1
        seen[f"peek {caller} found"] += len(found.blocks)
        return found

    pc.PrefixCache.index = counted_index  # type: ignore[method-assign]
    pc.PrefixCache.evict_many = counted_evict  # type: ignore[method-assign]
    pc.PrefixCache.peek = counted_peek  # type: ignore[method-assign]
    try:
        pt.measure(cfg)
    finally:
        pc.PrefixCache.index, pc.PrefixCache.evict_many, pc.PrefixCache.peek = index, evict, peek
    plans = cfg.warmup + cfg.steps
    return {k: round(v / plans, 2) for k, v in sorted(seen.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--policy", default="mlfq")
    ap.add_argument("--queued", type=int, default=5000)
    ap.add_argument("--num-blocks", type=int, default=65536)
    ap.add_argument("--host-kv-blocks", type=int, default=262144)
    ap.add_argument("--warmup", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    cfg = pt.PlanTimeConfig(policy=a.policy, queued=a.queued, num_blocks=a.num_blocks,
                            host_kv_blocks=a.host_kv_blocks, warmup=a.warmup, steps=a.steps,
                            clock="cpu")
    per_plan = count(cfg)
    for k, v in per_plan.items():
        print(f"{k:40s} {v:8.2f} a plan")
    if a.out is not None:
        a.out.write_text(json.dumps({"config": cfg.model_dump(), "per_plan": per_plan},
                                    indent=1) + "\n")


if __name__ == "__main__":
    main()
