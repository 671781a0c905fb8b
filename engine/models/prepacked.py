"""`F.linear` on weights prepacked once into oneDNN's blocked layout (CPU).

MKL's sgemm, behind `F.linear` on CPU, is slow where the output is very
wide and the input has few rows: the lm_head of a decode step (SmolLM2:
49,152 × 576, 1 to 128 rows) runs at 23–35 GFLOPS on one AVX2 core, while
oneDNN's matmul on a weight reordered once to its blocked layout runs at
44–60 on the same shapes (`studies/engine_cpu/README.md`).  The reorder is
what vLLM-CPU and Inductor's CPU weight prepacking do too; ATen exposes it
as `mkldnn._reorder_linear_weight` / `mkldnn._linear_pointwise`.

The lm_head (`PrepackedLinear`): a packed copy is made the first time the
weight is used and remade if the weight tensor is replaced or written in
place (its storage or version changes); the copy costs the head's size in
memory again, and the dense table stays for the embedding lookup it is
tied to.

The projections (`pack_in_place`, `packed_linear`): each projection's
parameter is replaced by its packed form after loading, so they cost no
extra memory; whether that pays depends on the CPU.  On an AVX2-only EPYC
MKL and oneDNN ran the layers' shapes about even (whole engine 0.88–1.06×,
`studies/engine_cpu/README.md`); on an AVX512 EPYC MKL stays at its AVX2
rate while oneDNN runs 2.3× faster (whole engine 1.55–1.98×).  In
bfloat16, which `F.linear` already multiplies on oneDNN where the CPU has
native bf16, the packed weight still gains at small batches (decode
1.04–1.54× there).  So `auto` times both on the model's largest
projection shape at start (`packing_speedup`) and packs where it wins by
`MIN_SPEEDUP`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import packed_bf16, packed_f32
from engine.models.linear import native_low_precision_cpu

# What `pack_projections` may say: pick (engine.models.packed_bf16 says
# when our VDPBF16PS kernel, engine.models.packed_f32 when our AVX2 FMA one;
# elsewhere time oneDNN against `F.linear`), force oneDNN's layout
# ("always") or one of ours ("bf16_dot", "f32_fma"), or neither.
PackMode = Literal["auto", "always", "bf16_dot", "f32_fma", "never"]
# `auto` packs where the packed matmul is at least this much faster: below
# it the probe's noise on a shared host could flip the choice from run to run.
MIN_SPEEDUP = 1.2
# Decode-batch rows the probe times, and how long it times each side.
_PROBE_ROWS = 16
_PROBE_S = 0.05

# Row count the reorder is tuned for: the middle of the decode batches served.
_ROWS_HINT = 64


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """float32 on a CPU whose torch build has oneDNN with the packed linear;
    bfloat16 too where oneDNN multiplies it natively (AVX512-BF16 / AMX).
    Not where bf16 is emulated (engine.models.linear computes it in float32
    there)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    return dtype is torch.float32 or native_low_precision_cpu(dtype)


class PrepackedLinear:
    """Callable as `F.linear(x, weight, bias)` for 2-D `x` on CPU (float32,
    or bfloat16 where `available`); with `ours` ("bf16_dot" or "f32_fma"), a
    weight that kernel (`engine.models.packed_bf16`, `.packed_f32`) takes is
    packed for it instead."""

    def __init__(self, ours: Literal["bf16_dot", "f32_fma"] | None = None,
                 codes: bool = True, bf16_codes: dict[int, torch.Tensor] | None = None) -> None:
        self.kernel: ModuleType | None = {
            "bf16_dot": packed_bf16, "f32_fma": packed_f32, None: None}[ours]
        # Whether `f32_fma` may keep a weight as its GGUF codes (packed_f32.pack).
        self.codes = codes
        # id(weight) -> the codes `bf16_dot` may keep beside it
        # (packed_bf16.pack_with_codes; from `CausalLM.load_weights`).
        self.bf16_codes = bf16_codes or {}
        # id(weight) -> (data_ptr, version, packed)
        self._packed: dict[int, tuple[int, int, torch.Tensor]] = {}

    def takes_ours(self, w: torch.Tensor) -> bool:
        """Whether `w` is multiplied on one of our kernels (batch-invariant,
        `engine.models.batch_invariant`) rather than oneDNN's."""
        return self.kernel is not None and self.kernel.packable(w)

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(id(w))
        if entry is None or entry[0] != w.data_ptr() or entry[1] != w._version:
            if self.kernel is packed_f32 and self.takes_ours(w):
                packed = packed_f32.pack(w, codes=self.codes)
            elif self.kernel is packed_bf16 and self.takes_ours(w):
                packed = packed_bf16.pack_with_codes(w, self.bf16_codes.get(id(w)))
            elif self.kernel is not None and self.takes_ours(w):
                packed = self.kernel.pack(w)
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _ROWS_HINT)
            entry = (w.data_ptr(), w._version, packed)
            self._packed[id(w)] = entry
        return entry[2]

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] == 0:
            return F.linear(x, w, b)
        return packed_linear(x, self._pack(w), b)

    def packed_weights(self) -> list[torch.Tensor]:
        """The packed copies made so far (the stats count their formats)."""
        return [entry[2] for entry in self._packed.values()]


def packed_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear` for a weight packed in place (`pack_in_place` here or in
    `engine.models.packed_bf16` / `.packed_f32`) or a plain one."""
    if packed_bf16.multiplies(w):  # its values, or its codes with them
        return packed_bf16.linear(x, w, b)
    if packed_f32.is_packed(w):
        return packed_f32.linear(x, w, b)
    if not w.is_mkldnn:
        return F.linear(x, w, b)
    if x.shape[0] == 0:
        return x.new_empty((0, w.shape[0]))
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


def projection_shape(w: torch.Tensor) -> tuple[int, int]:
    """(out, in) features of a projection's weight, plain or packed in place
    for one of our kernels (whose tensors have other shapes)."""
    if packed_bf16.is_packed(w):
        return w.shape[0] * 16, w.shape[1] * 2
    if packed_f32.is_packed(w) or packed_bf16.multiplies(w):
        return packed_f32.shape(w)  # float32 values, or codes of either dtype
    return w.shape[0], w.shape[-1]


def pack_in_place(module: nn.Module, names: tuple[str, ...]) -> int:
    """Replace every parameter of `module` whose last name is in `names` by its
    packed form; returns how many were packed.  Only `packed_linear` can use
    them afterwards (`F.linear` rejects a packed tensor rather than misread it)."""
    count = 0
    for sub in module.modules():
        for name in names:
            w = getattr(sub, name, None)
            if isinstance(w, nn.Parameter) and w.dim() == 2 and not w.is_mkldnn:
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _ROWS_HINT)
                setattr(sub, name, nn.Parameter(packed, requires_grad=False))
                count += 1
    return count


def _time(fn: Callable[[], object], budget_s: float) -> float:
    """Median seconds of `fn()` over about `budget_s` of calls (after a warm-up)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def packing_speedup(out_features: int, in_features: int, rows: int = _PROBE_ROWS,
                    dtype: torch.dtype = torch.float32) -> float:
    """How much faster the packed matmul is than `F.linear` on this CPU, on
    this thread pool, for a `[rows, in] x [out, in]^T` product in `dtype`."""
    x = torch.randn(rows, in_features).to(dtype)
    w = torch.randn(out_features, in_features).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, _ROWS_HINT)
    plain = _time(lambda: F.linear(x, w), _PROBE_S)
    fast = _time(lambda: packed_linear(x, packed), _PROBE_S)
    return plain / fast


def should_pack(mode: PackMode, speedup: float | None) -> bool:
    """`always`/`never` as said; `auto` where the probe measured a clear win."""
    if mode != "auto":
        return mode == "always"
    return speedup is not None and speedup >= MIN_SPEEDUP
