"""`RankedSet.ran` alone: an iteration's batch moved to the end of the
last-run orders, for sets of a few members to a GPU-sized pool's thousands.

    python studies/plan_time/ranked_ran.py <a checkout's root> [--out F.json]

Times the `scheduler/policies/ranked.py` of the given checkout (so that two
trees can be alternated in one session), µs a call, mean over the calls.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(a.root))
    from scheduler.job import Job

    spec = importlib.util.spec_from_file_location(
        "ranked_under_test", a.root / "scheduler/policies/ranked.py")
    assert spec is not None and spec.loader is not None
    ranked = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ranked)
    rows = []
    # (members, levels, batch): a small pool's resident set, then larger
    # ones, then a host tier's thousands of which a batch touches a few.
    for members, levels, batch in [(80, 6, 64), (120, 6, 64), (1300, 6, 64), (3000, 4, 8)]:
        rng = random.Random(0)
        jobs = {f"j{i}": Job(job_id=f"j{i}", prompt_token_ids=[1, 2, 3], max_tokens=4,
                             arrival_time=0.0) for i in range(members)}
        rank = {jid: (0, rng.randint(0, levels - 1), i) for i, jid in enumerate(jobs)}
        rs = ranked.RankedSet()
        rs.sync(jobs, rank, {jid: rng.random() for jid in jobs})
        ids, t, total = list(jobs), 1.0, 0
        for _ in range(a.calls):
            t += 1.0
            b = rng.sample(ids, batch)
            t0 = time.perf_counter_ns()
            rs.ran(b, t)
            total += time.perf_counter_ns() - t0
        us = total / a.calls / 1000
        print(f"members {members:5d} levels {levels} batch {batch:3d}: {us:7.1f} µs a call")
        rows.append({"members": members, "levels": levels, "batch": batch, "us": round(us, 2)})
    if a.out:
        tree = subprocess.run(["git", "-C", str(a.root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        a.out.write_text(json.dumps({"tree": tree, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
