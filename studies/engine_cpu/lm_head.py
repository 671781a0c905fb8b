"""The lm_head's matmul on CPU: MKL (`F.linear`) vs a oneDNN-prepacked weight.

Part 1 times the lm_head's shape alone (SmolLM2: 49,152 × 576, float32, one
thread) at decode batch sizes.  Part 2 times whole greedy decode steps of
our engine (`--batch` sequences sharing a 256-token context) with three
choices of matmul, each repetition running all three in turn so that a
noisy host slows them alike: MKL everywhere, the prepacked lm_head only
(what the engine does, `engine/models/prepacked.py`), every projection
prepacked.

    python -m studies.engine_cpu.lm_head --out studies/engine_cpu/lm_head.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.engine_bench import OursBench
from bench.engine_bench import parse_args as engine_args
from bench.report import machine_meta, write_report
from bench.sampling_bench import _median_ms
from engine.models.prepacked import PrepackedLinear


def gemm_rows(rows: list[int], reps: int) -> list[dict[str, float]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(49152, 576, generator=gen)
    packed = PrepackedLinear()
    out = []
    for m in rows:
        x = torch.randn(m, 576, generator=gen)
        mkl = _median_ms(lambda: F.linear(x, w), reps)
        onednn = _median_ms(lambda: packed(x, w), reps)
        flop = 2 * m * 576 * 49152
        out.append({"rows": m, "mkl_ms": round(mkl, 2), "packed_ms": round(onednn, 2),
                    "mkl_gflops": round(flop / mkl / 1e6, 1),
                    "packed_gflops": round(flop / onednn / 1e6, 1),
                    "max_abs_diff": (F.linear(x, w) - packed(x, w)).abs().max().item()})
        print(f"lm_head rows {m:4d}: MKL {mkl:7.2f} ms  packed {onednn:7.2f} ms", flush=True)
    return out


def decode_steps(batch: int, rounds: int) -> dict[str, float]:
    ea = engine_args(["--decode-context", "256", "--decode-steps", str(4 * rounds * 3 + 8),
                      "--warmup", "0", "--threads", "1", "--decode-batches", str(batch),
                      "--prefill-lens", "256"])
    ours = OursBench(ea, "float32")
    step = ours.start_decode(list(range(100, 356)), batch)
    model = ours.runner.model
    every = PrepackedLinear()
    variants = {"mkl": (F.linear, F.linear), "packed_head": (F.linear, PrepackedLinear()),
                "all_packed": (every, every)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(2):
        step()
    for _ in range(rounds):
        for name, (linear, head) in variants.items():
            model.linear, model.head_linear = linear, head
            step()  # first step after a switch packs the weights
            times[name].append((step() + step() + step()) / 3 * 1000)
    row = {f"{k}_ms": round(statistics.median(v), 1) for k, v in times.items()}
    print(f"decode batch {batch:3d}: " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return {"batch": batch, **row}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16,32,48,64,96,128")
    ap.add_argument("--batches", default="16,48,64,96")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    gemm = gemm_rows([int(r) for r in a.rows.split(",")], a.reps)
    steps = [decode_steps(int(b), a.rounds) for b in a.batches.split(",")]
    write_report({"meta": {"dtype": "float32", "threads": 1, "context": 256, **machine_meta()},
                  "lm_head_gemm": gemm, "decode_step": steps}, a.out)


if __name__ == "__main__":
    main()
