"""The bf16 projections' GEMM on VDPBF16PS (engine/csrc/gemm_bf16.cpp).

Runs where the operators' library has its AVX512-BF16 build (a CPU with
`avx512_bf16` and a C++ compiler); skipped elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import huge_pages
from engine.models import packed_bf16, prepacked
from engine.models.batch_invariant import TiledLinear

pytestmark = pytest.mark.skipif(not packed_bf16.built(),
                                reason="no AVX512-BF16 build of the C++ operators here")


@pytest.fixture(params=["tiles", "vectors"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel on AMX tiles (where the build has them; weights with K a
    multiple of 32) or on VDPBF16PS vectors only."""
    on = packed_bf16.amx(request.param == "tiles")
    if request.param == "tiles" and not on:
        pytest.skip("no AMX path in this build of the C++ operators")
    try:
        yield request.param
    finally:
        packed_bf16.amx(True)


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    return x, w, b


def _close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                    b: torch.Tensor | None) -> None:
    # The exact products of the bf16 values summed in float64, then rounded
    # once to bf16 by the kernel: within half a bf16 ulp plus float32's
    # summation error.
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs()).add(1e-30)
    err = (y.double() - exact).abs()
    assert y.dtype is torch.bfloat16 and y.shape == exact.shape
    assert bool((err <= exact.abs() * 2.0**-8 + scale * 2.0**-20 + 1e-6).all()), \
        float((err - exact.abs() * 2.0**-8).max())


def _same_on_one_and_two_threads(x: torch.Tensor, wp: torch.Tensor,
                                 b: torch.Tensor) -> torch.Tensor:
    """The product on one thread, after checking that two give its bits."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed_bf16.linear(x, wp, b)
        torch.set_num_threads(2)
        assert torch.equal(packed_bf16.linear(x, wp, b), one)
    finally:
        torch.set_num_threads(threads)
    return one


@pytest.mark.parametrize("m,n,k", [
    (1, 16, 2), (3, 48, 48), (8, 96, 64), (13, 80, 576), (32, 960, 576),
    (37, 32, 1536), (16, 48, 32), (17, 64, 576), (48, 112, 64),
    # More rows than one chunk (64 rows at K = 1,536), a tail block of 5.
    (197, 144, 1536),
    # Wider than 4,096 columns: computed in tiles, the last one partial.
    (9, 4112, 64), (40, 6160, 96),
])
def test_products_match_the_exact_sum_rounded_once(m: int, n: int, k: int, path: str) -> None:
    x, w, b = _operands(m, n, k, seed=m * 7 + n)
    wp = packed_bf16.pack(w)
    assert packed_bf16.is_packed(wp) and tuple(wp.shape) == (n // 16, k // 2, 16, 2)
    assert packed_bf16.out_features(wp) == n
    _close_to_exact(packed_bf16.linear(x, wp), x, w, None)
    _close_to_exact(packed_bf16.linear(x, wp, b), x, w, b)


def test_strided_and_empty_inputs(path: str) -> None:
    x, w, b = _operands(21, 64, 48, seed=3)
    wp = packed_bf16.pack(w)
    want = packed_bf16.linear(x, wp, b)
    # Rows of a wider tensor (even stride), and a transposed copy (not rows).
    wide = torch.zeros(21, 50, dtype=torch.bfloat16)
    wide[:, :48] = x
    assert torch.equal(packed_bf16.linear(wide[:, :48], wp, b), want)
    assert torch.equal(packed_bf16.linear(x.t().contiguous().t(), wp, b), want)
    odd = torch.zeros(21, 49, dtype=torch.bfloat16)
    odd[:, :48] = x
    assert torch.equal(packed_bf16.linear(odd[:, :48], wp, b), want)
    assert packed_bf16.linear(x[:0], wp).shape == (0, 64)


def test_rows_do_not_depend_on_the_rows_beside_them_or_the_threads(path: str) -> None:
    x, w, b = _operands(70, 4160, 576, seed=5)
    wp = packed_bf16.pack(w)
    together = _same_on_one_and_two_threads(x, wp, b)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 14), slice(64, 70), slice(1, 69),
                 slice(14, 47), slice(16, 32)):
        assert torch.equal(packed_bf16.linear(x[rows], wp, b), together[rows]), rows
    # Among other rows: the same row at a different place in its block.
    mixed = torch.cat([x[40:43], x[:9]])
    assert torch.equal(packed_bf16.linear(mixed, wp, b)[3:], together[:9])
    # Deterministic mode's tiles leave such a weight to the kernel as it is.
    tiled = TiledLinear(prepacked.packed_linear, rows=32)
    assert torch.equal(tiled(x[:7], wp, b), together[:7])


def test_row_blocks_of_even_size_give_the_bits_of_eights_and_a_tail() -> None:
    # A chunk of 9 rows multiplied as 5 + 4 (gemm_bf16.cpp, even_blocks) or
    # as 8 + 1: every element sums the same pairs of K in the same order.
    even = torch.ops.preempt_serve.set_gemm_even_rows
    x, w, b = _operands(70, 4160, 576, seed=11)
    wp = packed_bf16.pack(w)
    packed_bf16.amx(False)  # the tiles' path has row tiles of its own
    try:
        assert even(True)
        want = {r: packed_bf16.linear(x[:r], wp, b) for r in (9, 11, 17, 19, 25, 70)}
        _close_to_exact(want[70], x, w, b)
        assert not even(False)
        for r, got in want.items():
            assert torch.equal(packed_bf16.linear(x[:r], wp, b), got), r
            assert torch.equal(got, want[70][:r]), r
    finally:
        even(True)
        packed_bf16.amx(True)


def test_the_next_panels_prefetch_never_changes_the_bits() -> None:
    # Where the next weight panel is prefetched to (or whether it is at
    # all) is chosen by the row chunk's size and the CPU (gemm_bf16.cpp,
    # prefetch_hints); rows of every class, each hint, one bits.
    set_prefetch = torch.ops.preempt_serve.set_gemm_prefetch
    x, w, b = _operands(70, 4160, 576, seed=7)
    wp = packed_bf16.pack(w)
    packed_bf16.amx(False)  # the tiles' path prefetches nothing of this kind
    classes = (1, 9, 30, 70)  # one row, 2-16, 17-47, 48 and more
    shipped = [set_prefetch(r, -1) for r in classes]
    try:
        want = {r: packed_bf16.linear(x[:r], wp, b) for r in classes}
        _close_to_exact(want[70], x, w, b)
        for hint in (3, 2, 1, 0):
            for r in classes:
                assert set_prefetch(r, hint) == hint
            for r in classes:
                assert torch.equal(packed_bf16.linear(x[:r], wp, b), want[r]), (hint, r)
                assert torch.equal(want[r], want[70][:r])
        # A class's setting is its own; an out-of-range hint only reads it.
        set_prefetch(1, 0)
        assert set_prefetch(2, 1) == 1 and set_prefetch(16, -1) == 1
        assert set_prefetch(1, -1) == 0 and set_prefetch(17, 9) == 0
        with pytest.raises(RuntimeError, match="rows must be at least 1"):
            set_prefetch(0, 3)
    finally:
        for r, h in zip(classes, shipped):
            set_prefetch(r, h)
        packed_bf16.amx(True)


def test_k_in_passes_gives_the_bits_of_one_pass(path: str) -> None:
    # At K 1,536 on the tiles, three or more row tiles take K in passes with
    # the float32 sums stored between them; one or two row tiles take it in
    # one pass.  A row's bits must not tell which (nine panels: the group of
    # eight in pairs, then one alone).
    x, w, b = _operands(70, 144, 1536, seed=11)
    wp = packed_bf16.pack(w)
    together = _same_on_one_and_two_threads(x, wp, b)
    _close_to_exact(together, x, w, b)
    for rows in (slice(0, 1), slice(3, 35), slice(40, 70), slice(16, 48), slice(0, 33)):
        assert torch.equal(packed_bf16.linear(x[rows], wp, b), together[rows]), rows


def test_shapes_the_layout_cannot_take_are_refused_or_left() -> None:
    with pytest.raises(RuntimeError, match="multiple of 16"):
        packed_bf16.pack(torch.zeros(40, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        packed_bf16.pack(torch.zeros(32, 7, dtype=torch.bfloat16))
    wp = packed_bf16.pack(torch.zeros(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="columns"):
        packed_bf16.linear(torch.zeros(2, 10, dtype=torch.bfloat16), wp)
    layer = torch.nn.Module()
    layer.up = torch.nn.Parameter(torch.randn(32, 8).bfloat16(), requires_grad=False)
    layer.odd = torch.nn.Parameter(torch.randn(40, 8).bfloat16(), requires_grad=False)
    layer.f32 = torch.nn.Parameter(torch.randn(32, 8), requires_grad=False)
    dense_odd = layer.odd.detach().clone()
    assert packed_bf16.pack_in_place(layer, ("up", "odd", "f32")) == (1, 2)
    assert packed_bf16.is_packed(layer.up) and not packed_bf16.is_packed(layer.odd)
    # What the layout does not take goes through F.linear as before.
    x = torch.randn(3, 8).bfloat16()
    assert torch.equal(prepacked.packed_linear(x, layer.odd), F.linear(x, dense_odd))


def test_packed_projections_share_one_arena_on_huge_pages() -> None:
    # pack_in_place lays every projection of a module into one arena
    # (engine.huge_pages: 2 MiB pages where the platform gives them); each
    # holds the bits pack gives it alone, and pack itself puts a weight of
    # at least a huge page on one.
    gen = torch.Generator().manual_seed(3)
    layer = torch.nn.Module()
    shapes = {"q": (1024, 576), "o": (576, 576), "up": (2048, 576)}
    dense = {n: (torch.randn(*s, generator=gen) / 24).bfloat16() for n, s in shapes.items()}
    for n, w in dense.items():
        setattr(layer, n, torch.nn.Parameter(w.clone(), requires_grad=False))
    assert packed_bf16.pack_in_place(layer, tuple(shapes)) == (3, 0)
    packed = {n: getattr(layer, n) for n in shapes}
    bases = {p.untyped_storage().data_ptr() for p in packed.values()}
    assert len(bases) == 1
    alone = {n: torch.ops.preempt_serve.pack_bf16(w) for n, w in dense.items()}
    for n in shapes:
        assert torch.equal(packed[n], alone[n]), n
    first = min(p.data_ptr() for p in packed.values())
    big = packed_bf16.pack(dense["up"])
    assert torch.equal(big, alone["up"])
    if huge_pages.available():
        assert first % huge_pages.HUGE_PAGE == 0
        assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    x = torch.randn(5, 576, generator=gen).bfloat16()
    for n in shapes:
        assert torch.equal(packed_bf16.linear(x, packed[n]), packed_bf16.linear(x, alone[n]))


def test_the_runner_packs_projections_and_head_for_the_kernel(
        tiny_llama_path: Path, tiny_llama_d32_path: Path) -> None:
    from engine.runner import ModelRunner

    def runner(pack: str) -> ModelRunner:
        return ModelRunner(tiny_llama_path, "bfloat16", "cpu", num_blocks=8, block_size=4,
                           max_model_len=32, num_threads=1,
                           pack_projections=pack)  # type: ignore[arg-type]

    dot, plain = runner("bf16_dot"), runner("never")
    assert dot.model.packing == "bf16_dot" and dot.packing_speedup is None
    layer = dot.model.layers[0]
    assert all(packed_bf16.is_packed(getattr(layer, n)) for n in dot.model.projection_names)
    assert plain.model.packing == "none"
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, dot.model.config.hidden_size, generator=gen).bfloat16()
    logits, ref = dot.model.compute_logits(hidden), plain.model.compute_logits(hidden)
    assert logits is not None and ref is not None
    torch.testing.assert_close(logits.float(), ref.float(), rtol=2**-6, atol=2e-2)
    # `auto` takes the kernel where it is preferred: without AMX, or on its tiles.
    auto = runner("auto")
    if packed_bf16.preferred(torch.bfloat16, torch.device("cpu")):
        assert auto.model.packing == "bf16_dot"
    else:
        assert auto.model.packing in ("none", "onednn")
    # Deterministic mode's `auto`: on with the kernel and the C++ attention
    # (with a head dim the prefill operator's vector path takes), off with
    # oneDNN's weights, another attention backend or prompts attended by the
    # decode operator (head dim 16).
    def deterministic(pack: str, backend: str | None = None,
                      path: Path = tiny_llama_d32_path) -> bool:
        return ModelRunner(path, "bfloat16", "cpu", num_blocks=8, block_size=4,
                           max_model_len=32, num_threads=1, deterministic="auto",
                           attention_backend=backend,
                           pack_projections=pack).deterministic  # type: ignore[arg-type]
    assert deterministic("bf16_dot") is True
    assert deterministic("bf16_dot", "torch") is False
    assert deterministic("never") is False
    assert deterministic("bf16_dot", path=tiny_llama_path) is False


def test_the_tiles_take_a_weight_by_its_k_alone() -> None:
    # A weight whose K is a multiple of 32 is multiplied on the tiles at
    # every row count, one whose K is not on the vectors at every row count:
    # a build never switches kernel (and so bits) with the batch.
    if not packed_bf16.amx(True):
        pytest.skip("no AMX path in this build of the C++ operators")
    for k, tiles in ((576, True), (48, False)):
        x, w, b = _operands(40, 64, k, seed=k)
        wp = packed_bf16.pack(w)
        on = packed_bf16.linear(x, wp, b)
        assert packed_bf16.amx(False) is False and packed_bf16.on_tiles() is False
        try:
            off = packed_bf16.linear(x, wp, b)
        finally:
            assert packed_bf16.amx(True) and packed_bf16.on_tiles()
        # Both exact to within a rounding; they differ (or not) in the last
        # bits, by the path alone.
        _close_to_exact(on, x, w, b)
        _close_to_exact(off, x, w, b)
        if not tiles:
            assert torch.equal(on, off)
        for rows in (1, 7, 16, 33):
            assert torch.equal(packed_bf16.linear(x[:rows], wp, b), on[:rows])
