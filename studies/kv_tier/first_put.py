"""The first store into a fresh KV directory, and whether it made the directory actor import
torch: a local Ray cluster, a directory, a tier on it, then ROUNDS stores of BLOCKS
SmolLM2-shaped bf16 blocks (30 layers × K and V × 3 heads × 16 tokens × 64), timed each.

    python -m studies.kv_tier.first_put --out studies/kv_tier/first_put.json

Run it in a tree of an earlier commit (PYTHONPATH=that tree) for the tier as it was there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import ray
    import torch

    import kvstore.tier
    from kvstore.directory import KVDirectory

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    class Directory(KVDirectory.__ray_actor_class__):  # type: ignore[name-defined]
        def has_torch(self) -> bool:
            import sys

            return "torch" in sys.modules

    directory = Directory.remote(100_000)
    t = time.perf_counter()
    ray.get(directory.has_torch.remote())
    ready_s = time.perf_counter() - t
    tier = kvstore.tier.ObjectStoreTier(directory)
    puts = []
    for i in range(args.rounds):
        data = torch.randn(args.blocks, 30, 2, 3, 16, 64).to(torch.bfloat16)
        t = time.perf_counter()
        assert tier.offload(f"job-{i}", list(range(args.blocks)), data).result()
        puts.append(time.perf_counter() - t)
    tree = Path(kvstore.tier.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    out = {"tree_commit": commit, "actor_ready_s": ready_s, "put_s": puts,
           "actor_imported_torch": ray.get(directory.has_torch.remote())}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
