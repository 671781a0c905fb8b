"""What taking a decode's next block costs when the pool is full: the free
list is empty and the block comes from the prefix cache's parked ones (the
steady state of a loaded server with prefix caching).

    python -m studies.plan_time.decode_block [--jobs 400] [--rounds 5]

Prints the median ns of one `BlockManager.grow` that needs one block, over
`--jobs` decoding jobs, per round.  Run it against another checkout with
`PYTHONPATH=<that checkout>` to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time

from scheduler.blocks import BlockManager
from scheduler.job import Job

BLOCK = 16


def _round(num_jobs: int) -> float:
    bm = BlockManager(4096, BLOCK, prefix_caching=True)
    for k in range(120):  # finished jobs: their blocks parked, indexed
        j = Job(job_id=f"f{k}", prompt_token_ids=[10_000 + k] + [7] * 527, max_tokens=10,
                arrival_time=0.0)
        bm.grow(j, 528)
        j.num_computed_tokens = 528
        bm.free(j)
    jobs = []
    for k in range(num_jobs):  # decoding jobs whose last block just filled
        j = Job(job_id=f"d{k}", prompt_token_ids=[20_000 + k] + [7] * 99, max_tokens=100,
                arrival_time=0.0)
        bm.grow(j, 100)
        j.num_computed_tokens = 100
        bm.prefix.index(j, 100)  # its prompt, indexed once prefilled
        j.output_token_ids = [5] * 13
        j.num_computed_tokens = 112
        jobs.append(j)
    times = []
    for j in jobs:
        t0 = time.perf_counter_ns()
        assert bm.grow(j, 1)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    for r in range(a.rounds):
        print(f"round {r + 1}: {_round(a.jobs):.0f} ns per one-block grow")


if __name__ == "__main__":
    main()
