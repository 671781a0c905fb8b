"""How the bytes of one KV cache block are ordered: `rows` or `tiles`.

`rows` (every backend, every device): a block is `[block_size, kv_heads,
head_dim]`, a token's K (or V) for all its heads one contiguous row.

`tiles` (the C++ backend's AMX decode on bfloat16, `engine/attention_cpp.py`
says when): the same bytes per block, ordered as AMX tile loads read them,
so that a decode loads every tile as one run of memory and rearranges
nothing:

- keys `[kv_head][32-dim piece][token][32 dims]`: the piece of 16 tokens is
  one 16 × 64-byte tile (1 KB in a row), the left-hand side of the scores;
- values `[kv_head][16-dim column][token pair][16 dims][2 tokens]`: two
  keys' values of one dim side by side, the pair-interleaved right-hand side
  the tiles' bf16 dot product takes for the weighted sum.

The row layout reads keys as tiles at the token stride (64 bytes of every
`kv_heads * head_dim * 2`), and interleaves values by pairs of keys with
two unpacks per 32 keys and head, every layer and step; vLLM-CPU's AMX
operator keeps its cache prepacked the same way for the same reason
(`studies/engine_cpu/vllm_cpu/README.md`).

The KV tier and every swap and checkpoint see blocks in `rows`
(`KVCache.read_blocks` / `write_blocks` convert), so replicas whose CPUs
pick different layouts still exchange blocks.  The shapes of the cache
tensors do not change; only the order of the bytes within a block does.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

KVLayout = Literal["rows", "tiles"]


def pick_layout(tiles_usable: bool) -> KVLayout:
    """The C++ backend's layout: `tiles` where its AMX decode and prefill
    operators can serve one (`tiles_usable`), unless
    PREEMPT_SERVE_KV_LAYOUT=rows; PREEMPT_SERVE_KV_LAYOUT=tiles where they
    cannot is an error at start."""
    wanted = os.environ.get("PREEMPT_SERVE_KV_LAYOUT", "auto")
    if wanted not in ("auto", "rows", "tiles"):
        raise ValueError(f"PREEMPT_SERVE_KV_LAYOUT={wanted!r}: choose auto, rows or tiles")
    if wanted == "tiles" and not tiles_usable:
        raise ValueError(
            "PREEMPT_SERVE_KV_LAYOUT=tiles needs the C++ attention backend built with AMX and "
            "AVX512, bfloat16, a head dim of 32, 64, 96, 128 or 256, at most 16 query heads "
            "per KV head and a block_size in 16s")
    return "tiles" if tiles_usable and wanted != "rows" else "rows"


def _split(x: torch.Tensor) -> tuple[list[int], int, int, int]:
    *lead, bs, kvh, dim = x.shape
    if dim % 32 or bs % 2:
        raise ValueError(f"the tiles layout needs a head dim in 32s and an even block size, "
                         f"not {dim} and {bs}")
    return lead, bs, kvh, dim


def pack_keys(rows: torch.Tensor) -> torch.Tensor:
    """Keys `[..., block_size, kv_heads, dim]` in `rows` order into `tiles`
    order (same shape)."""
    lead, bs, kvh, dim = _split(rows)
    x = rows.reshape(*lead, bs, kvh, dim // 32, 32).movedim(-4, -2)
    return x.reshape(*lead, bs, kvh, dim)


def unpack_keys(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_keys`."""
    lead, bs, kvh, dim = _split(tiles)
    x = tiles.reshape(*lead, kvh, dim // 32, bs, 32).movedim(-2, -4)
    return x.reshape(*lead, bs, kvh, dim)


def pack_values(rows: torch.Tensor) -> torch.Tensor:
    """Values `[..., block_size, kv_heads, dim]` in `rows` order into
    `tiles` order (same shape)."""
    lead, bs, kvh, dim = _split(rows)
    n = len(lead)
    x = rows.reshape(*lead, bs // 2, 2, kvh, dim // 16, 16)
    x = x.permute(*range(n), n + 2, n + 3, n, n + 4, n + 1)
    return x.reshape(*lead, bs, kvh, dim)


def unpack_values(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_values`."""
    lead, bs, kvh, dim = _split(tiles)
    n = len(lead)
    x = tiles.reshape(*lead, kvh, dim // 16, bs // 2, 16, 2)
    x = x.permute(*range(n), n + 2, n + 4, n, n + 1, n + 3)
    return x.reshape(*lead, bs, kvh, dim)


def to_rows(blocks: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Whole blocks `[n, num_layers, 2, block_size, kv_heads, dim]` (K and V
    of each layer) from `layout` into `rows`."""
    if layout == "rows":
        return blocks
    return torch.stack((unpack_keys(blocks[:, :, 0]), unpack_values(blocks[:, :, 1])), dim=2)


def from_rows(blocks: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Inverse of `to_rows`."""
    if layout == "rows":
        return blocks
    return torch.stack((pack_keys(blocks[:, :, 0]), pack_values(blocks[:, :, 1])), dim=2)
