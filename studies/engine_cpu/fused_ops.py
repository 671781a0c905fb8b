"""Decode steps with and without the small C++ operators on CPU.

The operators are the bf16 RMSNorm (alone and with the residual sum before
it) and the rotation of q and k (`engine/csrc/norm_rotary.cpp`) and the
greedy argmax (`engine/csrc/logits.cpp`); the model and the sampler take them
wherever `engine.attention_cpp.loaded()` says the library is loaded.  The
switch leaves on the operators the layer takes by other tests (SiLU × up,
the K/V write: `studies/engine_cpu/layer_ops.py` times those).  Each round
runs five decode steps with them and five with that switch forced off
(ATen's op-by-op versions), on the same runner and sequences (`--batch`
sequences sharing a 300-token context, one thread), so that a noisy host
slows both alike; the medians of six rounds are reported.

    python -m studies.engine_cpu.fused_ops --out studies/engine_cpu/fused_ops.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import engine.attention_cpp as cpp
from bench.engine_bench import OursBench
from bench.engine_bench import parse_args as engine_args
from bench.report import machine_meta, write_report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.engine_cpu.fused_ops",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", default="8,32,96")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    per_round = 5
    rows = []
    for dtype in a.dtypes.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            steps = 3 + 2 * per_round * a.rounds + 1
            ea = engine_args(["--decode-batches", str(batch), "--decode-context", "300",
                              "--decode-steps", str(steps), "--warmup", "0", "--threads", "1",
                              "--no-hf", "--prefill-lens", "16"])
            bench = OursBench(ea, dtype)
            step = bench.start_decode(list(range(100, 400)), batch)
            for _ in range(3):
                step()
            loaded = cpp.loaded
            with_ops: list[float] = []
            without: list[float] = []
            try:
                for _ in range(a.rounds):
                    for switch, times in ((loaded, with_ops), (lambda: False, without)):
                        cpp.loaded = switch  # type: ignore[assignment]
                        t = time.perf_counter()
                        for _ in range(per_round):
                            step()
                        times.append((time.perf_counter() - t) / per_round)
            finally:
                cpp.loaded = loaded  # type: ignore[assignment]
            row = {"dtype": dtype, "batch": batch,
                   "with_ops_ms": round(statistics.median(with_ops) * 1e3, 2),
                   "aten_ms": round(statistics.median(without) * 1e3, 2)}
            row["speedup"] = round(row["aten_ms"] / row["with_ops_ms"], 3)
            rows.append(row)
            print(f"{dtype:>9} batch {batch:3d}: {row['with_ops_ms']:7.2f} ms with the operators, "
                  f"{row['aten_ms']:7.2f} ms op by op ({row['speedup']}x)")
    write_report({"meta": {"context": 300, "threads": 1, "rounds": a.rounds, **machine_meta()},
                  "rows": rows}, a.out)


if __name__ == "__main__":
    main()
