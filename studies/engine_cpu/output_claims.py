"""Outputs claimed before they are computed (engine/csrc/vec16.h, claim):
the bf16 GEMM on AMX tiles and the prefill operator, with and without, in
one process (`preempt_serve::set_output_claims`), one CPU thread.

- GEMM: SmolLM2's projections at `--rows` rows with the caches as a
  prefill leaves them (16 MB read between calls, then x read again, so x is
  in cache and the output's memory is not), ours both ways and oneDNN's
  packed matmul the same way, each weight one of 30 copies; medians of
  `--rounds` rounds.
- Whole engine: prefills of `--prefill-lens` tokens and decode steps at
  `--decode-batches` (256-token contexts, each sequence its own K/V), both
  ways alternated round by round; each round's ratio kept.

    taskset -c 0 python -m studies.engine_cpu.output_claims --out studies/engine_cpu/output_claims.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine_bench import OursBench
from bench.report import machine_meta, write_report
from bench.step_profile import engine_args
from engine.models import packed_bf16
from engine.models.prepacked import _ROWS_HINT, packed_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _claims(on: bool) -> None:
    torch.ops.preempt_serve.set_output_claims(on)


def gemm(name: str, rows: int, rounds: int) -> dict[str, object]:
    n, k = SHAPES[name]
    gen = torch.Generator().manual_seed(rows + n)
    plain = [(torch.randn(n, k, generator=gen) / k**0.5).bfloat16() for _ in range(30)]
    ours = [packed_bf16.pack(w) for w in plain]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, _ROWS_HINT) for w in plain]
    xs = [torch.randn(rows, k, generator=gen).bfloat16() for _ in range(8)]
    junk = torch.zeros(16 << 20, dtype=torch.uint8)

    def seconds(fn: Callable[[torch.Tensor, torch.Tensor], object], ws: list) -> float:
        total = 0.0
        for i, w in enumerate(ws):
            x = xs[i % len(xs)]
            junk.sum()
            x.sum()
            t = time.perf_counter()
            fn(x, w)
            total += time.perf_counter() - t
        return total / len(ws)

    times: dict[str, list[float]] = {"claims": [], "no_claims": [], "onednn": []}
    for _ in range(rounds):
        _claims(True)
        times["claims"].append(seconds(packed_bf16.linear, ours))
        _claims(False)
        times["no_claims"].append(seconds(packed_bf16.linear, ours))
        times["onednn"].append(seconds(packed_linear, onednn))
    _claims(True)
    flop = 2.0 * rows * n * k
    g = {way: round(flop / statistics.median(t) / 1e9, 1) for way, t in times.items()}
    return {"projection": name, "rows": rows, "output_mb": round(rows * n * 2 / 2**20, 2),
            "gflops": g, "claims_speedup": round(g["claims"] / g["no_claims"], 3),
            "claims_over_onednn": round(g["claims"] / g["onednn"], 3),
            "no_claims_over_onednn": round(g["no_claims"] / g["onednn"], 3)}


def alternate(step: Callable[[], object], rounds: int, reps: int) -> dict[str, object]:
    """Seconds per call both ways, alternated (which way first swaps a round)."""
    t: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            _claims(on)
            step()
            start = time.perf_counter()
            for _ in range(reps):
                step()
            t[on].append((time.perf_counter() - start) / reps)
    _claims(True)
    on, off = statistics.median(t[True]), statistics.median(t[False])
    return {"claims_ms": round(on * 1e3, 2), "no_claims_ms": round(off * 1e3, 2),
            "speedup": round(off / on, 3),
            "round_speedups": [round(b / a, 3) for a, b in zip(t[True], t[False])]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="256,1024,2048")
    ap.add_argument("--prefill-lens", default="512,1024,2048")
    ap.add_argument("--decode-batches", default="32,128")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    lens = [int(v) for v in a.prefill_lens.split(",")]
    batches = [int(v) for v in a.decode_batches.split(",")]
    steps = 2 * a.rounds * 3 + 8
    ours = OursBench(engine_args(["--decode-context", "256", "--decode-steps", str(steps),
                                  "--warmup", "0", "--threads", "1", "--distinct-kv",
                                  "--decode-batches", a.decode_batches,
                                  "--prefill-lens", a.prefill_lens]), "bfloat16")
    if not (packed_bf16.on_tiles() and torch.ops.preempt_serve.set_output_claims(True)):
        raise SystemExit("the bf16 GEMM is not on AMX tiles on this machine")
    results = []
    for rows in (int(v) for v in a.rows.split(",")):
        for name in SHAPES:
            r = gemm(name, rows, a.rounds)
            print(f"GEMM {name:8s} {rows:5d} rows: {r['gflops']} GFLOP/s, "
                  f"claims {r['claims_speedup']}x, {r['claims_over_onednn']}x oneDNN", flush=True)
            results.append(r)
    prefills = []
    for n in lens:
        prompt = list(range(100, 100 + n))
        r = {"tokens": n, **alternate(lambda: ours.prefill(prompt), a.rounds, 2)}
        print(f"prefill {n}: {r}", flush=True)
        prefills.append(r)
    decodes = []
    for b in batches:
        step = ours.start_decode(list(range(100, 356)), b)
        r = {"batch": b, **alternate(step, a.rounds, 2)}
        print(f"decode batch {b}: {r}", flush=True)
        decodes.append(r)
    write_report({"meta": {**machine_meta(), "threads": 1, "rounds": a.rounds},
                  "gemm_cold": results, "prefill": prefills, "decode": decodes}, a.out)


if __name__ == "__main__":
    main()
