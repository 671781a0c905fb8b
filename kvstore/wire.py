"""KV blocks as they travel to the directory actor: raw bytes with dtype and shape.

bf16 has no numpy dtype, so a block goes as a uint8 array (a zero-copy
view through the object store) with its torch dtype named.  This module
imports no torch: the `KVDirectory` actor unpickles these objects, and a
torch import there on its first put (1.2 s on an idle 2-core host, up to
6.6 s under load) would hold every swap queued behind that put.
"""

from __future__ import annotations

from typing import Any


class Wire:
    __slots__ = ("data", "dtype", "shape", "nbytes")

    def __init__(self, data: Any, dtype: str, shape: tuple[int, ...]) -> None:
        self.data = data
        self.dtype = dtype
        self.shape = shape
        self.nbytes = data.nbytes

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Wire, (self.data, self.dtype, self.shape))
