"""Every projection on a oneDNN-packed weight vs on its plain weight through
MKL (`pack_projections: always` vs `never`; the lm_head is packed in both):
prefill and decode tokens/s of our engine, float32 (or `--dtype bfloat16`
where the CPU multiplies bf16 natively), one thread, the two taking turns
run by run.  Which one `auto` picks depends on the CPU.

    python -m studies.engine_cpu.projections --out studies/engine_cpu/projections.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.engine_bench import _ints
from bench.report import machine_meta, write_report
from studies.engine_cpu.alternate import alternate, engines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.engine_cpu.projections")
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--prefill-lens", type=_ints, default=[512, 2048])
    p.add_argument("--decode-batches", type=_ints, default=[8, 32, 64, 96])
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    benches = engines(args.model, {"plain": ["--pack-projections", "never"],
                                   "packed": ["--pack-projections", "always"]},
                      args.prefill_lens, args.decode_batches, args.reps, args.dtype)
    rows = alternate(benches, args.prefill_lens, args.decode_batches, args.reps)
    write_report({"meta": machine_meta(), "results": rows}, args.out)


if __name__ == "__main__":
    main()
