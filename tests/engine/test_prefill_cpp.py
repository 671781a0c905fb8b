"""The C++ paged prefill operator: causal attention of prefill chunks (from
position 0 or later) over their blocks in place, against dense float64
attention, on the shapes its vector path is built for and on others; its
inputs checked; and the C++ backend routing a step's prefills through it."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

import pytest
import torch

import engine.attention_cpp as cpp
from engine.attention import SeqSpan, get_attention_backend
from tests.engine.test_attention_cpp import needs_cxx

# (start position, tokens) of each chunk of a call: whole prompts, later
# chunks, single tokens, chunks crossing many key tiles of 32.
CHUNKS = [(0, 37), (5, 1), (40, 70), (0, 130), (49, 2), (0, 1)]


def _case(chunks: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, bs: int,
          dtype: torch.dtype = torch.float32, seed: int = 0, spread: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    contexts = [s + n for s, n in chunks]
    num_blocks = sum(-(-c // bs) for c in contexts) + 5
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in contexts]
    keys = (torch.randn(num_blocks, bs, kv_heads, dim, generator=gen) * spread).to(dtype)
    values = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(sum(n for _, n in chunks), heads, dim, generator=gen).to(dtype)
    return q, keys, values, tables


def _reference(q, keys, values, tables, chunks) -> torch.Tensor:
    """Dense float64 causal attention of each chunk's tokens over its context."""
    _, _, kvh, d = keys.shape
    group = q.shape[1] // kvh
    out, tok = [], 0
    for table, (start, n) in zip(tables, chunks):
        ctx = start + n
        k = keys[table].reshape(-1, kvh, d)[:ctx].double().repeat_interleave(group, 1)
        v = values[table].reshape(-1, kvh, d)[:ctx].double().repeat_interleave(group, 1)
        s = torch.einsum("thd,khd->htk", q[tok : tok + n].double(), k) * d**-0.5
        hidden = torch.arange(ctx)[None, :] > torch.arange(start, ctx)[:, None]
        s = s.masked_fill(hidden, float("-inf"))
        out.append(torch.einsum("htk,khd->thd", s.softmax(-1), v))
        tok += n
    return torch.cat(out)


def _call(q, keys, values, tables, chunks) -> torch.Tensor:
    cpp.load_kernel()
    ids = torch.tensor([b for t in tables for b in t])
    starts = torch.tensor([0, *accumulate(len(t) for t in tables)][:-1])
    qstarts = torch.tensor([0, *accumulate(n for _, n in chunks)])
    positions = torch.tensor([s for s, _ in chunks])
    return torch.ops.preempt_serve.paged_prefill(q, keys, values, ids, starts, qstarts,
                                                 positions, q.shape[-1] ** -0.5)


SHAPES = [
    (9, 3, 64, 16),    # SmolLM2: tiles of 21 tokens x 3 heads
    (8, 8, 128, 16),   # no grouping: 64 tokens a tile
    (16, 2, 128, 8),   # a group of 8
    (4, 4, 96, 24),    # a block of 24
    (8, 2, 256, 16),   # the widest head dim
    (6, 3, 32, 16),    # the narrowest vector head dim
    (32, 1, 64, 16),   # a group of 32: two tokens a tile
    (6, 2, 8, 4),      # a head dim with no vector build
    (4, 1, 80, 32),    # another
    (8, 2, 128, 32),   # blocks of 32
    (9, 3, 64, 48),    # blocks of 48: a 32-key part of the tiles' steps spans two
]


@needs_cxx
@pytest.mark.parametrize("heads,kv_heads,dim,bs", SHAPES)
def test_prefill_matches_dense_attention(heads: int, kv_heads: int, dim: int, bs: int) -> None:
    q, keys, values, tables = _case(CHUNKS, heads, kv_heads, dim, bs)
    got = _call(q, keys, values, tables, CHUNKS)
    torch.testing.assert_close(got.double(), _reference(q, keys, values, tables, CHUNKS),
                               rtol=2e-5, atol=2e-5)


@pytest.fixture(params=["tiles", "vectors"])
def scores_on(request: pytest.FixtureRequest) -> Iterator[str]:
    """bf16 scores and weighted sums on AMX tiles (where the build has them:
    paged_prefill_amx.h) or on the vectors (VDPBF16PS scores)."""
    on = cpp.decode_amx(request.param == "tiles")
    if request.param == "tiles" and not on:
        pytest.skip("no AMX path in this build of the C++ operators")
    try:
        yield request.param
    finally:
        cpp.decode_amx(True)


def _bf16_bound() -> float:
    """The absolute part of a bf16 output's error bound (beside 2^-8 of its
    size): p rounded once to bf16 for the weighted sum, as the vectors' key
    pairs and the tiles' one term take it (2^-9 relative,
    `test_p_rounded_once_stays_near_the_finer_sums`), else kept to ~16 bits
    in the tiles' two terms or to float32 in the vectors' FMAs."""
    return 5e-3 if _value_pairs() else 2e-3


def _value_pairs(on: bool = True) -> bool:
    """Switch the vectors' bf16 weighted sums to key pairs (or off them);
    whether they take pairs now (False where the build has no such path)."""
    cpp.load_kernel()
    return bool(torch.ops.preempt_serve.set_prefill_value_pairs(on)) and on


@needs_cxx
@pytest.mark.parametrize("heads,kv_heads,dim,bs", SHAPES)
def test_prefill_bfloat16_within_its_rounding(heads: int, kv_heads: int, dim: int,
                                              bs: int, scores_on: str) -> None:
    # Products of bf16 inputs are exact in float32 and every sum is float32:
    # the error is the output's own rounding (2^-8 relative) and p's.
    q, keys, values, tables = _case(CHUNKS, heads, kv_heads, dim, bs, dtype=torch.bfloat16)
    got = _call(q, keys, values, tables, CHUNKS).double()
    ref = _reference(q, keys, values, tables, CHUNKS)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    assert ((got - ref).abs() <= ref.abs() * 2**-8 + _bf16_bound()).all()


@needs_cxx
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [s for s in SHAPES if s[2] % 32 == 0])
def test_p_rounded_once_stays_near_the_finer_sums(heads: int, kv_heads: int, dim: int,
                                                  bs: int, scores_on: str) -> None:
    # set_prefill_value_pairs: on VDPBF16PS two keys' values go in one
    # instruction, on the tiles p goes in one bf16 term, p rounded to bf16
    # for either; off, p stays float32 (the vectors' FMAs, key by key) or
    # ~16 bits (the tiles' two terms).  Both ways within their bounds, the
    # rounded p's error a little larger, and the path switched.
    try:
        if not _value_pairs(True):
            pytest.skip("no VDPBF16PS build of the C++ operators here")
        q, keys, values, tables = _case(CHUNKS, heads, kv_heads, dim, bs, dtype=torch.bfloat16)
        ref = _reference(q, keys, values, tables, CHUNKS)
        once = _call(q, keys, values, tables, CHUNKS).double()
        _value_pairs(False)
        finer = _call(q, keys, values, tables, CHUNKS).double()
    finally:
        _value_pairs(True)
    assert ((finer - ref).abs() <= ref.abs() * 2**-8 + 2e-3).all()
    assert ((once - ref).abs() <= ref.abs() * 2**-8 + 5e-3).all()
    assert not torch.equal(once, finer)
    rel = lambda got: ((got - ref).abs() / (ref.abs() + 1e-3)).median().item()  # noqa: E731
    assert rel(finer) <= rel(once) < 3 * rel(finer) + 1e-4


@needs_cxx
@pytest.mark.parametrize("spread", [1.0, 40.0])
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [(9, 3, 64, 16), (8, 2, 128, 32)])
def test_the_tiles_short_exponential_rounds_p_as_closely(heads: int, kv_heads: int, dim: int,
                                                         bs: int, spread: float) -> None:
    # set_short_exp: the tiles' one-term p as 2^(x log2 e) on a degree-4
    # polynomial (~3e-6 relative) instead of the degree-7 e^x (~1e-7); p is
    # rounded to bf16 (2^-9 relative) next, so only the few p near a
    # rounding boundary land one bf16 step elsewhere: the same bound against
    # float64, about the same median error, and the path switched where the
    # weights spread (spread 40: running maxima that move, rescaled sums,
    # weights that underflow; nearly every p there is 1 or far below it).
    if not cpp.decode_amx(True):
        pytest.skip("no AMX path in this build of the C++ operators")
    chunks = [(0, 300), (90, 40), *CHUNKS]
    q, keys, values, tables = _case(chunks, heads, kv_heads, dim, bs, dtype=torch.bfloat16,
                                    spread=spread)
    ref = _reference(q, keys, values, tables, chunks)
    try:
        _value_pairs(True)
        assert torch.ops.preempt_serve.set_short_exp(False)
        full = _call(q, keys, values, tables, chunks).double()
        assert torch.ops.preempt_serve.set_short_exp(True)
        short = _call(q, keys, values, tables, chunks).double()
    finally:
        torch.ops.preempt_serve.set_short_exp(True)
    for got in (full, short):
        assert ((got - ref).abs() <= ref.abs() * 2**-8 + 5e-3).all()
    assert spread > 1.0 or not torch.equal(short, full)
    assert (short != full).double().mean() < 0.05
    rel = lambda got: ((got - ref).abs() / (ref.abs() + 1e-3)).median().item()  # noqa: E731
    assert rel(short) < 1.1 * rel(full) + 1e-5


@needs_cxx
def test_prefill_online_softmax_keeps_extreme_scores_exact() -> None:
    # Scores spanning hundreds: the running maximum moves from key tile to
    # key tile and early tiles' weights underflow; still the dense softmax.
    # Scores this large carry float32 rounding of ~1e-5 each, which the
    # softmax passes on as relative error; a wrong rescale would be off by
    # whole units.
    chunks = [(0, 150), (90, 40)]
    q, keys, values, tables = _case(chunks, 6, 2, 64, 16, spread=40.0)
    got = _call(q, keys, values, tables, chunks)
    ref = _reference(q, keys, values, tables, chunks)
    assert ref.abs().max() > 1.0  # not a trivial average
    torch.testing.assert_close(got.double(), ref, rtol=2e-4, atol=2e-4)


@needs_cxx
def test_bfloat16_keeps_extreme_scores(scores_on: str) -> None:
    # The same spread in bfloat16 on either path: running maxima that move
    # by more than the slack they may trail by rescale the sums exactly.
    chunks = [(0, 300), (90, 40)]
    q, keys, values, tables = _case(chunks, 6, 2, 64, 16, dtype=torch.bfloat16, spread=40.0)
    got = _call(q, keys, values, tables, chunks).double()
    ref = _reference(q, keys, values, tables, chunks)
    assert ref.abs().max() > 1.0
    assert ((got - ref).abs() <= ref.abs() * 2**-8 + _bf16_bound()).all()


@needs_cxx
def test_prefill_chunks_agree_with_the_whole_prompt() -> None:
    # A prompt prefilled in three chunks reads the same keys as one chunk,
    # and each row's arithmetic is its own (deterministic mode): the same bits.
    q, keys, values, tables = _case([(0, 100)], 9, 3, 64, 16)
    whole = _call(q, keys, values, tables, [(0, 100)])
    parts = [(0, 33), (33, 1), (34, 66)]
    cut = _call(q, keys, values, tables * 3, parts)
    assert torch.equal(cut, whole)


@needs_cxx
def test_bfloat16_chunks_agree_with_the_whole_prompt(scores_on: str) -> None:
    # The same in bfloat16, on either way of computing the products: a key's
    # score for a row, and a dim's sum for it, are fixed by the two alone
    # (tiles of 16 or 32 keys from position 0, 16 rows a tile however many
    # the chunk has).
    q, keys, values, tables = _case([(0, 100)], 9, 3, 64, 16, dtype=torch.bfloat16)
    whole = _call(q, keys, values, tables, [(0, 100)])
    for parts in ([(0, 33), (33, 1), (34, 66)], [(0, 5), (5, 17), (22, 78)]):
        assert torch.equal(_call(q, keys, values, tables * 3, parts), whole), parts


@needs_cxx
def test_the_products_take_the_tiles_where_the_build_has_them() -> None:
    # With p kept fine (the tiles' two bf16 terms, ~16 bits; the vectors'
    # float32 FMAs) their rounding differs in a few elements, by one rounding
    # step of the output; with p rounded once to bf16 on both (the tiles' one
    # term, the vectors' key pairs) in fewer still.  All within the bf16
    # bound above, and which path ran shows.
    q, keys, values, tables = _case(CHUNKS, 9, 3, 64, 16, dtype=torch.bfloat16)
    if not cpp.decode_amx(True):
        pytest.skip("no AMX path in this build of the C++ operators")
    got: dict[tuple[bool, bool], torch.Tensor] = {}
    try:
        for fine in (True, False):
            _value_pairs(not fine)
            for tiles in (True, False):
                assert cpp.decode_amx(tiles) == tiles
                got[fine, tiles] = _call(q, keys, values, tables, CHUNKS)
    finally:
        cpp.decode_amx(True)
        _value_pairs(True)
    for fine in (True, False):
        tiles, vectors = got[fine, True], got[fine, False]
        assert (tiles != vectors).double().mean() < 0.02
        assert (tiles.double() - vectors.double()).abs().max() < 0.02
    assert not torch.equal(got[True, True], got[True, False])
    assert not torch.equal(got[True, True], got[False, True])


@needs_cxx
def test_prefill_threads_split_tiles_without_changing_results() -> None:
    q, keys, values, tables = _case(CHUNKS, 9, 3, 64, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _call(q, keys, values, tables, CHUNKS)
        torch.set_num_threads(2)
        two = _call(q, keys, values, tables, CHUNKS)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_cxx
def test_prefill_rejects_inputs_it_cannot_read() -> None:
    q, keys, values, tables = _case([(0, 8)], 4, 2, 16, 4)
    cpp.load_kernel()
    op = torch.ops.preempt_serve.paged_prefill
    ids, starts, pos = torch.tensor(tables[0]), torch.tensor([0]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="cover q's tokens"):
        op(q, keys, values, ids, starts, torch.tensor([0, 7]), pos, 0.25)
    with pytest.raises(RuntimeError, match="needs a query token"):
        op(q[:0], keys, values, ids, starts, torch.tensor([0, 0]), pos, 0.25)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q.double(), keys, values, ids, starts, torch.tensor([0, 8]), pos, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        op(q, keys, values, ids.int(), starts, torch.tensor([0, 8]), pos, 0.25)


@needs_cxx
def test_backend_attends_prefills_with_the_operator() -> None:
    heads, kvh, dim, bs = 9, 3, 64, 16
    backend = get_attention_backend("cpp")(heads, kvh, dim, bs, torch.device("cpu"))
    reference = get_attention_backend("torch")(heads, kvh, dim, bs, torch.device("cpu"))
    if not cpp.prefill_vectorized(dim, heads // kvh):
        assert backend.prefill_kernel is None  # SDPA keeps the prefills here
        pytest.skip("prefills stay on SDPA on this build")
    assert backend.prefill_kernel is not None
    # Two decodes, then a whole prompt and a later chunk of another.
    chunks = [(20, 1), (47, 1), (0, 45), (30, 25)]
    q, keys, values, tables = _case(chunks, heads, kvh, dim, bs)
    spans = [SeqSpan(s, n, t) for (s, n), t in zip(chunks, tables)]
    md = backend.build_metadata(spans)
    assert [(p.mask, p.block_ids) for p in md.prefills] == [(None, None)] * 2
    assert md.prefill_block_ids.tolist() == tables[2] + tables[3]
    assert md.prefill_table_starts.tolist() == [0, len(tables[2])]
    assert md.prefill_query_starts.tolist() == [0, 45, 70]
    assert md.prefill_start_positions.tolist() == [0, 30]
    # The step's new keys and values, as the model hands them over.
    rows = [(t[p // bs], p % bs) for (s, n), t in zip(chunks, tables) for p in range(s, s + n)]
    k_new = torch.stack([keys[b, o] for b, o in rows])
    v_new = torch.stack([values[b, o] for b, o in rows])
    got = backend.forward(q, k_new, v_new, keys.clone(), values.clone(), md, dim**-0.5)
    want = reference.forward(q, k_new, v_new, keys.clone(), values.clone(),
                             reference.build_metadata(spans), dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), _reference(q, keys, values, tables, chunks),
                               rtol=2e-5, atol=2e-5)
