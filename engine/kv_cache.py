"""Paged KV cache tensors: the device memory the scheduler's block ids name.

Layout per layer: K and V each `[num_blocks, block_size, num_kv_heads,
head_dim]`, both layers and K/V stacked into one allocation
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`.

Within a block the bytes are in `rows` order (below) or, for the C++
backend's AMX decode, in `tiles` order (engine/kv_layout.py); the shapes are
the same either way, and `read_blocks` / `write_blocks` always speak `rows`.

Why this layout: a token's K (or V) for all heads is one contiguous row, so
a step's new tokens are written by flat slot id (`block * block_size +
offset`), a row each: one `index_copy_` on the torch path, the Triton
`_store_kv` kernel on CUDA's default backend, one copy per token in the C++
backend (engine/csrc/kv_write.cpp; `write_kv_tiles` for the tiles layout);
and gathering a sequence is one `index_select` of whole blocks that yields
`[blocks, block_size, heads, dim]` already in token order.  A block (all
its tokens and heads) is contiguous within a layer, which is what a swap or
checkpoint copies (kvstore).  One allocation up front, never resized: the
scheduler's `BlockManager` owns the numbers, this owns the bytes.
"""

from __future__ import annotations

import torch

from engine.device_lists import index
from engine.kv_layout import KVLayout, from_rows, to_rows


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: KVLayout = "rows",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout: KVLayout = layout
        # Zeroed rather than empty: a masked-out padding slot must never hold
        # NaN bit patterns, which would leak through 0 * NaN in some kernels.
        self.data = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
            dtype=dtype, device=device,
        )
        # Each layer's views, made once: two indexing ops a layer otherwise,
        # a few microseconds each at every step.
        self._keys = [self.data[layer, 0] for layer in range(num_layers)]
        self._values = [self.data[layer, 1] for layer in range(num_layers)]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def key(self, layer: int) -> torch.Tensor:
        """`[num_blocks, block_size, num_kv_heads, head_dim]` view of layer K."""
        return self._keys[layer]

    def value(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks, `[n, num_layers, 2, block_size, kv_heads, head_dim]`
        (all layers, K and V of one block together: the unit a host tier stores),
        in `rows` order whatever this cache's layout."""
        idx = index(block_ids, self.device)
        return to_rows(self.data.movedim(2, 0).index_select(0, idx), self.layout)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Inverse of `read_blocks`.  From pinned host memory the copy is
        queued on the current stream without waiting (the caching host
        allocator keeps `blocks` until it is done)."""
        idx = index(block_ids, self.device)
        src = blocks.to(device=self.device, dtype=self.dtype, non_blocking=blocks.is_pinned())
        src = from_rows(src, self.layout).movedim(0, 2)
        self.data.index_copy_(2, idx, src)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies over all layers, K and V."""
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads
            * self.head_dim * self.data.element_size()
        )

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
