"""Decode steps on float32 projections with each decoder layer as one C++
operator (`decode_layer_f32`, engine/csrc/decode_layer.cpp) against the
op-by-op layers, alternated step by step in one process.

The engine on SmolLM2 in float32 with its projections on their GGUF codes
(`pack_projections: f32_fma`, `weight_codes`), one thread, each sequence on
its own copy of a `--context`-token context (`bench.engine_bench
--distinct-kv`).  Every other step runs with the one-operator layers turned
off (`_layer_args` patched to refuse), so both modes decode the same
sequences over the same caches and the host's swings fall on both alike.
Both give the same bits (tests/engine/test_decode_layer.py), so the tokens
are the same whichever mode ran a step.

    taskset -c 1 python -m studies.engine_cpu.decode_layer_f32 \\
        --out studies/engine_cpu/decode_layer_f32.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

from bench.engine_bench import OursBench, parse_args as bench_args
from bench.report import machine_meta, write_report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=40, help="timed steps per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--deterministic", action="store_true",
                   help="the engine in deterministic mode (the server's default on CPU)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    bench = OursBench(bench_args([
        "--decode-batches", a.batches, "--decode-steps", str(2 * a.steps), "--warmup", "2",
        "--decode-context", str(a.context), "--prefill-lens", "16", "--distinct-kv",
        "--threads", "1", "--pack-projections", "f32_fma",
        *(["--deterministic"] if a.deterministic else [])]), "float32")
    model = bench.runner.model
    assert model.packing == "f32_fma" and model.weight_codes(), "needs f32_fma on codes"
    gen = torch.Generator().manual_seed(0)
    vocab = min(bench.runner.vocab_size, len(bench.runner.tokenizer))
    rows: list[dict[str, Any]] = []
    for b in batches:
        ms: dict[str, list[float]] = {"one_op": [], "op_by_op": []}
        for _ in range(a.rounds):
            prompt = torch.randint(100, vocab, (bench.ctx,), generator=gen).tolist()
            step = bench.start_decode(prompt, b)
            step()
            step()
            times: dict[str, list[float]] = {"one_op": [], "op_by_op": []}
            for i in range(2 * a.steps):
                if i % 2 == 0:
                    times["one_op"].append(step() * 1e3)
                else:
                    with patch.object(model, "_layer_args", lambda batch, n: None):
                        times["op_by_op"].append(step() * 1e3)
            for mode, t in times.items():
                ms[mode].append(statistics.median(t))
        row = {"batch": b, "ms": ms,
               "speedup": [round(o / f, 3) for f, o in zip(ms["one_op"], ms["op_by_op"])]}
        print(row, flush=True)
        rows.append(row)
    meta = {"model": "embedded:smollm2", "dtype": "float32", "threads": 1,
            "deterministic": a.deterministic,
            "context": a.context, "steps": a.steps, "rounds": a.rounds,
            "statistic": "median of each round's steps", **machine_meta()}
    write_report({"meta": meta, "results": rows}, a.out)


if __name__ == "__main__":
    main()
