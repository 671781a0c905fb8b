"""Deterministic mode's prefill with prompt positions on the prefill operator.

Three engines timed alternately (`studies.engine_cpu.alternate`), SmolLM2,
one thread, in bfloat16 and float32: the default engine; deterministic mode
as shipped (prompt positions through the C++ prefill operator, whose result
for a position does not depend on how its prompt is cut); and deterministic
mode with that operator switched off, every position walking its context
alone through the decode operator (how the mode attended prompts before).
Prefill of one prompt of 512 and 2,048 tokens, decode at batch 8 (unchanged
by this, as a control; `--decode-batches` for others).

    python -m studies.engine_cpu.deterministic_prefill --out studies/engine_cpu/deterministic_prefill.json
    python -m studies.engine_cpu.deterministic_prefill --dtypes float32 --decode-batches 1,8,32 --out studies/engine_cpu/deterministic_prefill_avx2.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.report import machine_meta, write_report
from studies.engine_cpu.alternate import alternate, engines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.engine_cpu.deterministic_prefill",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--decode-batches", default="8")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    batches = [int(b) for b in a.decode_batches.split(",")]
    for dtype in a.dtypes.split(","):
        benches = engines(a.model, {"default": [], "det_prefill_op": ["--deterministic"],
                                    "det_decode_op": ["--deterministic"]},
                          [512, 2048], batches, a.reps, dtype=dtype)
        assert benches["det_prefill_op"].runner.attn.prefill_kernel is not None, (
            "this build has no prefill operator")
        benches["det_decode_op"].runner.attn.prefill_kernel = None
        results[dtype] = alternate(benches, [512, 2048], batches, a.reps)
    write_report({"meta": {"threads": 1, "reps": a.reps, **machine_meta()},
                  "results": results}, a.out)


if __name__ == "__main__":
    main()
