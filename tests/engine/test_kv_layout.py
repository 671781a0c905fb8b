"""The tiles layout of a CPU cache block (engine/kv_layout.py): where each
element lies, the write operator that stores it, the AMX decode that reads
it, and an engine that serves with it token for token as with rows."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import engine.attention_cpp as cpp
from engine.kv_cache import KVCache
from engine.kv_layout import (
    from_rows,
    pack_keys,
    pack_values,
    pick_layout,
    to_rows,
    unpack_keys,
    unpack_values,
)
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.tier import LocalHostTier
from scheduler.plan import Plan
from tests.engine.helpers import drive

HAS_CXX = shutil.which("c++") is not None or shutil.which("g++") is not None
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
needs_amx = pytest.mark.skipif(not (HAS_CXX and cpp.amx_wanted()),
                               reason="no AMX (amx_tile, amx_bf16) on this CPU")


@pytest.mark.parametrize("bs,kvh,dim", [(16, 3, 64), (2, 1, 32), (32, 2, 96)])
def test_every_element_lies_where_the_tiles_read_it(bs: int, kvh: int, dim: int) -> None:
    rows = torch.randn(5, bs, kvh, dim)
    keys, values = pack_keys(rows), pack_values(rows)
    assert keys.shape == values.shape == rows.shape
    kflat, vflat = keys.reshape(5, -1), values.reshape(5, -1)
    for t, h, d in [(0, 0, 0), (bs - 1, kvh - 1, dim - 1), (1, kvh // 2, 33 % dim),
                    (bs // 2, 0, 17)]:
        # Keys: [kv_head][32-dim piece][token][32 dims].
        assert kflat[3, ((h * (dim // 32) + d // 32) * bs + t) * 32 + d % 32] == rows[3, t, h, d]
        # Values: [kv_head][16-dim column][token pair][16 dims][2 tokens].
        at = ((h * (dim // 16) + d // 16) * (bs // 2) + t // 2) * 32 + (d % 16) * 2 + t % 2
        assert vflat[3, at] == rows[3, t, h, d]
    assert torch.equal(unpack_keys(keys), rows) and torch.equal(unpack_values(values), rows)
    blocks = torch.randn(4, 3, 2, bs, kvh, dim)  # [n, layers, K/V, ...]
    assert torch.equal(to_rows(from_rows(blocks, "tiles"), "tiles"), blocks)
    assert not torch.equal(from_rows(blocks, "tiles"), blocks)
    with pytest.raises(ValueError, match="head dim in 32s"):
        pack_keys(torch.zeros(2, 4, 1, 48))


def test_the_layout_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREEMPT_SERVE_KV_LAYOUT", raising=False)
    assert pick_layout(True) == "tiles" and pick_layout(False) == "rows"
    monkeypatch.setenv("PREEMPT_SERVE_KV_LAYOUT", "rows")
    assert pick_layout(True) == "rows"
    monkeypatch.setenv("PREEMPT_SERVE_KV_LAYOUT", "tiles")
    assert pick_layout(True) == "tiles"
    with pytest.raises(ValueError, match="needs the C.. attention backend built with AMX"):
        pick_layout(False)
    monkeypatch.setenv("PREEMPT_SERVE_KV_LAYOUT", "packed")
    with pytest.raises(ValueError, match="choose auto, rows or tiles"):
        pick_layout(True)


def test_a_tiles_cache_reads_and_writes_blocks_in_rows() -> None:
    kw = dict(num_layers=2, num_blocks=6, block_size=16, num_kv_heads=3, head_dim=64,
              dtype=torch.bfloat16, device="cpu")
    rows, tiles = KVCache(**kw), KVCache(**kw, layout="tiles")  # type: ignore[arg-type]
    blocks = torch.randn(3, 2, 2, 16, 3, 64).bfloat16()
    rows.write_blocks([4, 0, 2], blocks)
    tiles.write_blocks([4, 0, 2], blocks)
    assert torch.equal(tiles.read_blocks([0, 2, 4]), rows.read_blocks([0, 2, 4]))
    assert not torch.equal(tiles.data, rows.data)  # the same blocks, other bytes
    assert torch.equal(tiles.data[1, 0, 4], pack_keys(blocks[0, 1, 0]))
    assert torch.equal(tiles.data[0, 1, 2], pack_values(blocks[2, 0, 1]))


@needs_cxx
def test_write_kv_tiles_writes_the_packed_rows() -> None:
    cpp.load_kernel()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(40, 3, 64, generator=g).bfloat16()
    v = torch.randn(40, 3, 64, generator=g).bfloat16()
    slots = torch.randperm(8 * 16, generator=g)[:40]
    rows_k = torch.zeros(8, 16, 3, 64, dtype=torch.bfloat16)
    rows_v = torch.zeros_like(rows_k)
    torch.ops.preempt_serve.write_kv(k, v, rows_k, rows_v, slots)
    tiles_k, tiles_v = torch.zeros_like(rows_k), torch.zeros_like(rows_k)
    torch.ops.preempt_serve.write_kv_tiles(k, v, tiles_k, tiles_v, slots)
    assert torch.equal(tiles_k, pack_keys(rows_k)) and torch.equal(tiles_v, pack_values(rows_v))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.preempt_serve.write_kv_tiles(k[:2], v[:2], tiles_k, tiles_v,
                                               torch.tensor([3, 8 * 16]))
    assert torch.equal(tiles_k, pack_keys(rows_k))  # every slot checked before writing
    with pytest.raises(RuntimeError, match="2-byte dtype"):
        torch.ops.preempt_serve.write_kv_tiles(k.float(), v.float(), tiles_k.float(),
                                               tiles_v.float(), slots)


def _decode_case(contexts: list[int], heads: int, kv_heads: int, dim: int, bs: int,
                 ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    sizes = [-(-c // bs) for c in contexts]
    ids = torch.randperm(200, generator=g)[: sum(sizes)]  # no block in two tables
    keys = torch.randn(200, bs, kv_heads, dim, generator=g).bfloat16()
    values = torch.randn(200, bs, kv_heads, dim, generator=g).bfloat16()
    q = torch.randn(len(contexts), heads, dim, generator=g).bfloat16()
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0)[:-1].tolist()])
    return q, keys, values, ids.long(), starts.long(), torch.tensor(contexts)


@needs_amx
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [
    (9, 3, 64, 32), (9, 3, 64, 16), (16, 1, 64, 48), (4, 4, 96, 32), (8, 2, 256, 16),
    (6, 3, 32, 64), (16, 2, 128, 16),
])
def test_the_tiles_decode_is_the_rows_decode(heads: int, kv_heads: int, dim: int,
                                             bs: int) -> None:
    cpp.load_kernel()
    assert cpp.decode_amx(True)
    contexts = [1, 2, 15, 16, 17, 31, 33, bs + 1, 3 * bs - 1, 300]
    q, keys, values, ids, starts, lens = _decode_case(contexts, heads, kv_heads, dim, bs)
    rows = torch.ops.preempt_serve.paged_decode(q, keys, values, ids, starts, lens, 0.125)
    # Past each context the blocks hold whatever was there: NaN must not leak.
    pk, pv = keys.clone(), values.clone()
    for i, c in enumerate(contexts):
        last = ids[starts[i] + (c - 1) // bs]
        pk[last, (c - 1) % bs + 1:] = float("nan")
        pv[last, (c - 1) % bs + 1:] = float("nan")
    tk, tv = pack_keys(pk), pack_values(pv)
    tiles = torch.ops.preempt_serve.paged_decode_tiles(q, tk, tv, ids, starts, lens, 0.125)
    assert torch.isfinite(tiles).all()
    if bs % 32 == 0:
        # The same tiles in the same order: the same bits.
        assert torch.equal(tiles, rows)
    else:
        # Blocks of 16: the weighted sum takes 16 keys a tile multiply, not
        # 32; the float32 sums round differently, by the output's last bit.
        diff = (tiles.float() - rows.float()).abs()
        assert (diff <= rows.float().abs() * 2**-7 + 1e-6).all()
    with pytest.raises(RuntimeError, match="needs the AMX build"):
        torch.ops.preempt_serve.paged_decode_tiles(q.float(), tk.float(), tv.float(), ids,
                                                   starts, lens, 0.125)


@needs_amx
def test_an_engine_on_tiles_serves_as_one_on_rows(smollm2_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 with blocks of 32, where the tiles decode gives the rows decode's
    # bits: chunked prefills read their context back from tiles, swaps
    # carry blocks out and in through the host tier, and every token is the
    # same as with rows.
    prompts = {f"j{i}": list(range(100 + 37 * i, 100 + 37 * i + n))
               for i, n in enumerate([70, 9, 130, 45, 96])}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = {}
    for layout in ("rows", "tiles"):
        monkeypatch.setenv("PREEMPT_SERVE_KV_LAYOUT", layout)
        runner = ModelRunner(smollm2_path, "bfloat16", "cpu", num_blocks=7, block_size=32,
                             max_model_len=224, num_threads=1)
        assert runner.attn.kv_layout == runner.kv_cache.layout == layout
        tier = LocalHostTier(capacity_bytes=10**9)
        runner.set_kv_tier(tier)
        result = drive(runner, prompts, params, num_blocks=7, block_size=32,
                       max_model_len=224, max_batch_tokens=64, swap_mode="reactive",
                       host_kv_blocks=64)
        assert result.core is not None
        runner.execute(Plan(0, [], block_ops=result.core.swap.take_pending()))
        assert result.core.swap.num_swap_in > 0 and tier.stats.fetches > 0
        got[layout] = result.tokens
    assert got["tiles"] == got["rows"]


needs_bf16_dot = pytest.mark.skipif(
    not (HAS_CXX and cpp.bf16_dot_wanted() and cpp.prefill_vectorized(64, 3)),
    reason="no AVX512 build with the bf16 dot product on this CPU")


@needs_bf16_dot
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [
    (9, 3, 64, 16), (9, 3, 64, 32), (8, 2, 256, 16), (6, 3, 32, 16), (32, 1, 64, 16),
    (4, 4, 96, 24), (16, 2, 128, 2), (9, 3, 64, 48),
])
def test_the_prefill_reads_a_tiles_cache_as_it_reads_rows(heads: int, kv_heads: int,
                                                          dim: int, bs: int) -> None:
    from itertools import accumulate

    from tests.engine.test_prefill_cpp import CHUNKS, _case

    q, keys, values, tables = _case(CHUNKS, heads, kv_heads, dim, bs, torch.bfloat16)
    args = (torch.tensor([b for t in tables for b in t]),
            torch.tensor([0, *accumulate(len(t) for t in tables)][:-1]),
            torch.tensor([0, *accumulate(n for _, n in CHUNKS)]),
            torch.tensor([s for s, _ in CHUNKS]), dim**-0.5)
    cpp.load_kernel()
    op = torch.ops.preempt_serve.paged_prefill
    rows = op(q, keys, values, *args)
    tiles = op(q, pack_keys(keys), pack_values(values), *args, True)
    assert torch.equal(tiles, rows)  # the same numbers in the same order
    with pytest.raises(RuntimeError, match="tiles-layout cache needs"):
        op(q.float(), keys.float(), values.float(), *args, True)
