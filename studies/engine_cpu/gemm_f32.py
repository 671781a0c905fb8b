"""float32 projections three ways on one CPU thread: `F.linear` on the plain
weight (MKL's sgemm), oneDNN's matmul on its own prepacked weight
(`engine.models.prepacked`), and our AVX2 FMA kernel on its layout
(`engine.models.packed_f32`), at SmolLM2's shapes with weights drawn from
memory as in a decode step (`gemm_bf16.py` says how each is timed).  Also
the kernel's rate on a 2,048-row GEMM of the gate_up shape (operands in
cache), near the core's FMA peak.

    taskset -c 1 python -m studies.engine_cpu.gemm_f32 --out studies/engine_cpu/gemm_f32.json
"""

from __future__ import annotations

import torch

from engine.models import packed_f32
from studies.engine_cpu.gemm_bf16 import run


def main(argv: list[str] | None = None) -> None:
    run(argv, __doc__, packed_f32, "f32_fma", torch.float32, other="f_linear")


if __name__ == "__main__":
    main()
