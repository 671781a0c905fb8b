"""How much memory the matmul caches add to an engine process, and whether
it levels off.

A packed matmul (`mkldnn._linear_pointwise`) keeps what it built for each
(weight shape, row count) it meets in two least-recently-used caches: ATen's
ideep layer's (LRU_CACHE_CAPACITY, default 1,024 entries) and oneDNN's
primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY, default 1,024).  An engine
meets a new row count with almost every mixed iteration (1 to
`max_batch_tokens` rows), which is why the soak's Engine replica kept
growing.  This probe multiplies SmolLM2's packed projection shapes (qkv, o,
gate/up, down; bf16 where the CPU multiplies it natively, else float32) at
every row count from 1 to `--rows` in a shuffled order, `--sweeps` times,
and samples the process's RSS every `--every` row counts.  Each `--envs`
entry (space-separated VAR=value settings, or "default") runs in a process
of its own, since the variables are read when the libraries start.

    python -m studies.hardening.onednn_cache --out studies/hardening/onednn_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

# (out, in) of the projections one Llama layer of SmolLM2 packs; gate and up
# share a shape, so a primitive.
SHAPES = [(960, 576), (576, 576), (1536, 576), (576, 1536)]


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def probe(rows: int, sweeps: int, every: int, seed: int) -> dict:
    import torch

    from engine.models.linear import native_low_precision_cpu
    from engine.models.prepacked import packed_linear

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if native_low_precision_cpu(torch.bfloat16) else torch.float32
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i).to(dtype), 64)
               for o, i in SHAPES]
    x = torch.randn(rows, max(i for _, i in SHAPES)).to(dtype)
    rng = random.Random(seed)
    samples = [{"keys_met": 0, "rss_mb": round(_rss_mb(), 1)}]
    met = 0
    start = time.perf_counter()
    for sweep in range(sweeps):
        order = list(range(1, rows + 1))
        rng.shuffle(order)
        for n, m in enumerate(order, 1):
            for w in weights:
                packed_linear(x[:m, : w.shape[1]], w)
            met += len(weights)
            if n % every == 0 or n == rows:
                samples.append({"sweep": sweep, "keys_met": met, "rss_mb": round(_rss_mb(), 1)})
    return {"dtype": str(dtype).removeprefix("torch."), "wall_s": round(time.perf_counter() - start, 1),
            "distinct_keys": rows * len(SHAPES), "samples": samples}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.hardening.onednn_cache",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--sweeps", type=int, default=2)
    ap.add_argument("--every", type=int, default=64)
    ap.add_argument("--envs", default="default;ONEDNN_PRIMITIVE_CACHE_CAPACITY=256;"
                    "LRU_CACHE_CAPACITY=256 ONEDNN_PRIMITIVE_CACHE_CAPACITY=256",
                    help="';'-separated runs, each 'default' or VAR=value settings")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(probe(a.rows, a.sweeps, a.every, a.seed)))
        return
    runs = []
    for spec in a.envs.split(";"):
        env = dict(os.environ)
        settings = {} if spec == "default" else dict(x.split("=", 1) for x in spec.split())
        env.update(settings)
        done = subprocess.run(
            [sys.executable, "-m", "studies.hardening.onednn_cache", "--child",
             "--rows", str(a.rows), "--sweeps", str(a.sweeps), "--every", str(a.every),
             "--seed", str(a.seed)],
            env=env, capture_output=True, text=True, check=True)
        run = {"env": settings, **json.loads(done.stdout.strip().splitlines()[-1])}
        s = run["samples"]
        first_full = next((x for x in s if x["keys_met"] >= 1024), s[-1])
        run["rss_growth_mb"] = round(s[-1]["rss_mb"] - s[0]["rss_mb"], 1)
        run["growth_after_1024_keys_mb"] = round(s[-1]["rss_mb"] - first_full["rss_mb"], 1)
        run["peak_rss_mb"] = max(x["rss_mb"] for x in s)
        runs.append(run)
        print(f"{spec}: {run['dtype']}, RSS {s[0]['rss_mb']:.0f} -> "
              f"{s[-1]['rss_mb']:.0f} MB (peak {run['peak_rss_mb']:.0f}); after the first "
              f"1,024 keys {run['growth_after_1024_keys_mb']:+.0f} MB; {run['wall_s']} s")
    report = {"meta": {"rows": a.rows, "sweeps": a.sweeps, "shapes": SHAPES,
                       "threads": 1}, "runs": runs}
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
