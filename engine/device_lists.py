"""Small host lists (row indices, per-row parameters) as device tensors,
without making the host wait for the device.

`torch.tensor(values, device="cuda")`, like indexing a CUDA tensor with a
Python list, copies from pageable memory and then synchronizes the stream:
the host waits for every pass queued before the copy.  With the next
iteration planned while a pass runs (`scheduler/ahead.py`) a pass is always
queued, so one such copy takes that iteration's overlap away.  Staged
through page-locked memory the copy is queued like a kernel instead (the
caching host allocator keeps the staging buffer until the copy is done).
On a CPU this is the host tensor itself.  The host tensor is built through
numpy: `torch.tensor` of a Python list takes ~3x as long (13 against 4 µs
for 128 ints), and a step builds several such lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# The dtypes a step's lists take, by their numpy twins.
_NUMPY = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32,
          torch.bool: np.bool_}


def on_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """`values` as a 1-D `dtype` tensor on `device`, its copy queued on the
    current stream without waiting for the work before it."""
    twin = _NUMPY.get(dtype)
    if twin is None:
        return staged(torch.tensor(values, dtype=dtype), device)
    return staged(torch.from_numpy(np.asarray(values, dtype=twin)), device)


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor's copy on `device`, queued as `on_device` queues it."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row indices for `index_select` / `index_copy_` on `device`."""
    return on_device(rows, torch.long, device)
