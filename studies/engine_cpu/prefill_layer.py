"""Prompt prefills with each decoder layer as one C++ operator
(`prefill_layer_bf16` / `prefill_layer_f32`, engine/csrc/decode_layer.cpp)
against the op-by-op layers, alternated prefill by prefill in one process.

The engine on SmolLM2 in bfloat16 on our packed projections (`bf16_dot`), or
with `--dtype float32` on our float32 ones (`f32_fma`, the weights on their
GGUF codes: what `auto` runs on an AVX2 CPU), one thread, in deterministic mode as the server runs it on CPU unless
`--no-deterministic`.  Every other prefill runs with the one-operator layers
turned off (`_layer_args` patched to refuse), each on a fresh prompt of
random token ids, so the host's swings fall on both modes alike.  Both give
the same bits (tests/engine/test_decode_layer.py).

    taskset -c 0 python -m studies.engine_cpu.prefill_layer \\
        --out studies/engine_cpu/prefill_layer_zen4.json
    taskset -c 0 python -m studies.engine_cpu.prefill_layer --dtype float32 \\
        --out studies/engine_cpu/prefill_layer_f32_zen4.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

from bench.engine_bench import OursBench, parse_args as bench_args
from bench.report import machine_meta, write_report

PACKING = {"bfloat16": "bf16_dot", "float32": "f32_fma"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lens", default="16,32,128,512")
    p.add_argument("--reps", type=int, default=15, help="timed prefills per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-deterministic", action="store_true")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    lens = [int(n) for n in a.lens.split(",")]
    bench = OursBench(bench_args([
        "--prefill-lens", a.lens, "--decode-batches", "1", "--threads", "1",
        "--pack-projections", PACKING[a.dtype],
        *([] if a.no_deterministic else ["--deterministic"])]), a.dtype)
    model = bench.runner.model
    assert model.packing == PACKING[a.dtype], f"no build of the operators for {a.dtype} here"
    gen = torch.Generator().manual_seed(0)
    vocab = min(bench.runner.vocab_size, len(bench.runner.tokenizer))

    def prefill(n: int) -> float:
        prompt = torch.randint(100, vocab, (n,), generator=gen).tolist()
        t = time.perf_counter()
        bench.prefill(prompt)
        return (time.perf_counter() - t) * 1e3

    rows: list[dict[str, Any]] = []
    for n in lens:
        ms: dict[str, list[float]] = {"one_op": [], "op_by_op": []}
        for _ in range(a.rounds):
            prefill(n)
            times: dict[str, list[float]] = {"one_op": [], "op_by_op": []}
            for i in range(2 * a.reps):
                if i % 2 == 0:
                    times["one_op"].append(prefill(n))
                else:
                    with patch.object(model, "_layer_args", lambda batch, t: None):
                        times["op_by_op"].append(prefill(n))
            for mode, t in times.items():
                ms[mode].append(round(statistics.median(t), 3))
        row = {"prompt_tokens": n, "ms": ms,
               "speedup": [round(o / f, 3) for f, o in zip(ms["one_op"], ms["op_by_op"])]}
        print(row, flush=True)
        rows.append(row)
    meta = {"model": "embedded:smollm2", "dtype": a.dtype, "packing": model.packing,
            "weight_codes": sorted(model.weight_codes()), "threads": 1,
            "deterministic": not a.no_deterministic, "reps": a.reps, "rounds": a.rounds,
            "statistic": "median of each round's prefills (the whole `execute`, sampling "
                         "included)", **machine_meta()}
    write_report({"meta": meta, "results": rows}, a.out)


if __name__ == "__main__":
    main()
