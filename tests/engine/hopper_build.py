"""Builds the top-k / top-p search kernel for NVIDIA targets without a GPU
(Triton's compiler and the ptxas it ships), outside Triton's interpreter.

    python -m tests.engine.hopper_build

Prints one line per (target, dtype) built; fails on the first that does
not build.  Run by tests/engine/test_top_k_top_p_triton.py in a process of
its own, since the suite's process has the interpreter switched on."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.top_k_top_p_triton import _BLOCK, _MAX_PASSES, _PIVOTS, _cut_rows

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}


def main() -> None:
    for name, target in TARGETS.items():
        for dtype in ("fp32", "bf16", "fp16"):
            signature = {
                "logits": f"*{dtype}", "out": f"*{dtype}", "top_k": "*i64", "top_p": "*fp32",
                "vocab": "i32", "stride_in": "i32", "stride_out": "i32",
                "BLOCK": "constexpr", "PIVOTS": "constexpr", "MAX_PASSES": "constexpr"}
            src = ASTSource(fn=_cut_rows, signature=signature, constexprs={
                "BLOCK": _BLOCK, "PIVOTS": _PIVOTS, "MAX_PASSES": _MAX_PASSES})
            built = triton.compile(src, target=target, options={"num_warps": 4})
            print(f"{name} {dtype}: {len(built.asm['cubin'])} bytes of cubin", flush=True)


if __name__ == "__main__":
    main()
