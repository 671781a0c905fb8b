"""Projections whose every row rounds the same whatever else is in the batch.

A GEMM library chooses its kernel, its blocking and its split between
threads from the shape of each call.  On an AVX2 core MKL rounds a row
multiplied alone differently from the same row multiplied among 2 to 100
others, every time, with one thread or two (`studies/engine_cpu/
batch_invariance.py`).  So in an ordinary engine a token's projections, hence its greedy
continuation, depend on how many other tokens share its step: on which
requests run beside it, on chunking, on whether it is recomputed after a
preemption.  In float32 that rarely flips a token; in bfloat16 it often does.

`TiledLinear` makes every call the same shape: the rows are cut into tiles
of `rows` (the last padded with zeros) and each tile is multiplied on its
own.  Every row then goes through the same kernel, with the same order of
its dot products and the same thread split, wherever it sits and whatever
shares its step.  This is the CPU counterpart of the fixed-tile matmul that
vLLM's and SGLang's batch-invariant modes run on GPUs (after Thinking
Machines, "Defeating Nondeterminism in LLM Inference", 2025), and of ours
(`engine.models.matmul_triton`), built from the library's own GEMM instead
of a new one.  The price is the padding of the
last tile and smaller GEMMs for long prefills; `tests/engine/
test_batch_invariant.py` checks the invariance on the machine it runs on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models import packed_bf16, packed_f32
from engine.models.linear import LinearFn, float32_slices, upcast_linear
from engine.models.prepacked import PrepackedLinear

# Rows per GEMM call.  32 keeps a (32 x 576) x (576 x 1536) product at ~85 %
# of the rate of one 2048-row call on an AVX2 core, while a decode step pads
# at most 31 rows.
TILE_ROWS = 32


class TiledLinear:
    """Callable as `F.linear(x, weight, bias)`: `inner` applied tile by tile.

    Where `inner` is the float32-compute path for emulated bf16/fp16
    (`engine.models.linear`), the weight is converted once per call (in
    fixed slices of output rows, as that path does for big weights) rather
    than once per tile, and the tiles are multiplied in float32.
    """

    def __init__(self, inner: LinearFn, rows: int = TILE_ROWS) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.inner = inner
        self.rows = rows

    def _invariant(self, w: torch.Tensor) -> bool:
        """Whether `inner` multiplies by `w` batch-invariantly as it is: on
        our VDPBF16PS or AVX2 FMA kernel (or their AMX tiles, or their GGUF
        codes), which sum every element in an order fixed by the weight alone
        (engine/csrc/gemm_bf16.cpp, gemm_f32.cpp), so no tiles."""
        if packed_bf16.multiplies(w) or packed_f32.is_packed(w):
            return True
        return isinstance(self.inner, PrepackedLinear) and self.inner.takes_ours(w)

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        n, rows = x.shape[0], self.rows
        upcast = self.inner is upcast_linear
        if (n == rows and not upcast) or self._invariant(w):
            return self.inner(x, w, b)
        padded = -(-n // rows) * rows
        if padded != n:
            xp = x.new_zeros(padded, x.shape[1])
            xp[:n] = x
            x = xp
        out = torch.empty(padded, w.shape[0], dtype=x.dtype, device=x.device)
        if upcast:
            xf = x.float()
            for c0, c1, wf, bf in float32_slices(w, b):
                for r0 in range(0, padded, rows):
                    # Assignment rounds to the model dtype, as `.to()` would.
                    out[r0 : r0 + rows, c0:c1] = F.linear(xf[r0 : r0 + rows], wf, bf)
        else:
            for r0 in range(0, padded, rows):
                out[r0 : r0 + rows] = self.inner(x[r0 : r0 + rows], w, b)
        return out[:n]
