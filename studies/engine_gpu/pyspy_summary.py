"""Where one thread of a py-spy profile spends its samples.

Reads py-spy's raw (collapsed) output, `--threads` on, gzipped or not, and
prints for the thread named `--thread` the functions with the most samples
of their own (the innermost frame) and the most samples under them
(anywhere in the stack), each as a share of that thread's samples.  Native
time (a CUDA call, a garbage collection started by an allocation) counts
for the Python frame that was running.

    python -m studies.engine_gpu.pyspy_summary studies/engine_gpu/head_and_host/pyspy_loop.txt.gz
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from pathlib import Path


def summarise(path: Path, thread: str) -> tuple[int, Counter[str], Counter[str]]:
    """Samples of the thread, and per function (file and name, no line) its
    own samples and its samples inclusive."""
    opener = gzip.open if path.suffix == ".gz" else open
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    total = 0
    with opener(path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if thread not in frames[0]:
                continue
            n = int(count)
            total += n
            names = [re.sub(r":\d+\)$", ")", fr) for fr in frames[1:]]
            own[names[-1] if names else "(no Python frame)"] += n
            for name in set(names):
                under[name] += n
    return total, own, under


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--thread", default="engine-loop")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    total, own, under = summarise(args.profile, args.thread)
    print(f"thread {args.thread!r}: {total} samples")
    for title, counts in (("own samples", own), ("samples inclusive", under)):
        print(f"\n{title}")
        for name, n in counts.most_common(args.top):
            print(f"{n:6d} {100 * n / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
