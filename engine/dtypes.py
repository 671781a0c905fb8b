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
