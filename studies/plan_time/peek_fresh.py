"""`PrefixCache.peek` of a job the cache has not read yet, finding n cached
blocks: what an arrival with a cached prompt costs to look up.

    python studies/plan_time/peek_fresh.py <a checkout's root> [--blocks 1,8,64] [--out F.json]

Times the `scheduler/prefix_cache.py` of the given checkout (so that two trees
can be alternated in one session): µs a lookup, the best of five runs of
2,000.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import timeit
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--blocks", default="1,8,64")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(a.root))
    from scheduler.job import Job
    from scheduler.prefix_cache import PrefixCache

    bs = 16
    rows = []
    for n in (int(x) for x in a.blocks.split(",")):
        cache = PrefixCache(bs)
        tokens = [1000 + i for i in range(n * bs)] + [5]
        owner = Job("a", list(tokens), 4, 0.0)
        owner.block_table[:] = list(range(n))
        owner.num_computed_tokens = n * bs
        cache.index(owner, owner.num_computed_tokens)

        def lookup() -> int:
            return len(cache.peek(Job("b", list(tokens), 4, 0.0)).blocks)

        assert lookup() == n
        us = min(timeit.repeat(lookup, number=2000, repeat=5)) / 2000 * 1e6
        rows.append({"blocks": n, "us": round(us, 2)})
        print(f"{n:4d} blocks found: {us:7.2f} µs a lookup")
    if a.out is not None:
        commit = subprocess.run(["git", "-C", str(a.root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        a.out.write_text(json.dumps({"tree": commit, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
