"""The model dtypes the engine accepts, by their config-file names."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}"
        ) from None


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX).

    Without it, PyTorch emulates bf16 matmuls and a forward pass runs about
    6x slower than in float32 (measured on an AVX2-only EPYC).  ATen held
    below AVX512 (`ATEN_CPU_CAPABILITY=avx2`) counts as without it: its
    kernels, and the C++ operators built for its capability, then emulate
    bf16 as on such a CPU.
    """
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` → the fastest exact-enough dtype for the device."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if native_bf16_cpu() else "float32"
