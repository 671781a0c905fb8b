"""float32 projections kept as a GGUF weight's codes (engine/csrc/gemm_f32_codes.cpp).

Runs wherever the operators' library builds with AVX2 and FMA; skipped
elsewhere.  The reference is the same kernel on the decoded float32 weight:
the products must be the same bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import huge_pages
from engine.models import packed_f32, prepacked

pytestmark = pytest.mark.skipif(not packed_f32.built(),
                                reason="no AVX2 FMA build of the C++ operators here")


def _q4_1(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight as a Q4_1 GGUF decodes: every 32 along a row m + d q, d and
    m float16, q in 0..15, the block's smallest value q = 0 and its largest
    q = 15 (GGUF's quantizer sets m and d from them)."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half().float()
    m = (torch.rand(n, k // 32, 1, generator=gen) - 0.5).mul(0.2).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    q[:, :, 0], q[:, :, 1] = 0, 15
    return (d * q + m).reshape(n, k)


def _q8_0(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight as a Q8_0 GGUF decodes: every 32 along a row d q, d float16,
    q in -127..127, the largest magnitude 127 (d is that value / 127)."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen)
    q[:, :, 5] = -127
    return (d * q).reshape(n, k)


@pytest.mark.parametrize("make,fmt,block_bytes", [(_q4_1, "q4", 384), (_q8_0, "q8", 576)])
@pytest.mark.parametrize("m,n,k", [
    (1, 16, 32), (5, 48, 576), (32, 960, 576),
    # One row chunk of 97 rows at K = 1,536 (float32 weights take four),
    # and two of 4 MiB of x (gemm_f32_codes.cpp's row chunks).
    (97, 48, 1536), (700, 32, 1536),
])
def test_codes_give_the_float32_weights_products_bit_for_bit(
        make, fmt: str, block_bytes: int, m: int, n: int, k: int) -> None:
    w = make(n, k, seed=m + n + k)
    packed, dense = packed_f32.pack(w), packed_f32.pack(w, codes=False)
    assert packed_f32.code_format(packed) == fmt and packed_f32.is_packed(packed)
    assert tuple(packed.shape) == (n // 16, k // 32, block_bytes)
    assert packed.numel() * 3 < dense.numel() * 4  # a third of the bytes or fewer
    assert packed_f32.shape(packed) == prepacked.projection_shape(packed) == (n, k)
    gen = torch.Generator().manual_seed(k)
    x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    assert torch.equal(packed_f32.linear(x, packed), packed_f32.linear(x, dense))
    assert torch.equal(packed_f32.linear(x, packed, b), packed_f32.linear(x, dense, b))
    assert torch.equal(prepacked.packed_linear(x, packed, b), packed_f32.linear(x, dense, b))
    assert packed_f32.linear(x[:0], packed).shape == (0, n)


def test_rows_threads_and_strides_do_not_change_the_bits() -> None:
    w = _q4_1(1024, 576, seed=3)
    packed = packed_f32.pack(w)
    gen = torch.Generator().manual_seed(1)
    x, b = torch.randn(45, 576, generator=gen), torch.randn(1024, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([packed_f32.linear(x[i : i + 1], packed, b) for i in range(45)])
        together = packed_f32.linear(x, packed, b)
        torch.set_num_threads(2)
        assert torch.equal(packed_f32.linear(x, packed, b), together)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    wide = torch.zeros(45, 600)
    wide[:, 10:586] = x
    assert torch.equal(packed_f32.linear(wide[:, 10:586], packed, b), together)


def test_a_weight_not_exactly_on_a_grid_stays_float32() -> None:
    w = _q4_1(32, 64, seed=5)
    off = w.clone()
    off[7, 40] = torch.nextafter(off[7, 40], torch.tensor(1.0))  # one ulp off its grid
    nan = w.clone()
    nan[3, 3] = float("nan")
    for bad in (off, nan, torch.randn(32, 64)):
        packed = packed_f32.pack(bad)
        assert packed.dtype is torch.float32 and packed_f32.code_format(packed) is None
    # K not in 32s: float32 as before.
    assert packed_f32.pack(torch.zeros(32, 48)).dtype is torch.float32
    # A constant block (a scale of 0) is codes too.
    flat = torch.full((16, 64), 0.5)
    packed = packed_f32.pack(flat)
    assert packed_f32.code_format(packed) == "q4"
    x = torch.randn(2, 64)
    assert torch.equal(packed_f32.linear(x, packed),
                       packed_f32.linear(x, packed_f32.pack(flat, codes=False)))


def test_values_share_one_arena_on_huge_pages_and_codes_stay_apart() -> None:
    # pack_in_place keeps each weight with codes as them and lays every
    # weight kept as float32 values into one arena (engine.huge_pages:
    # 2 MiB pages where the platform gives them); each holds the bits that
    # pack gives it alone, and pack itself puts values of at least a huge
    # page on one.
    gen = torch.Generator().manual_seed(5)
    layer = torch.nn.Module()
    dense = {"q": torch.randn(1024, 576, generator=gen) / 24,
             "up": torch.randn(2048, 576, generator=gen) / 24,
             "down": _q8_0(576, 1536, seed=2)}
    for n, w in dense.items():
        setattr(layer, n, torch.nn.Parameter(w.clone(), requires_grad=False))
    assert packed_f32.pack_in_place(layer, tuple(dense)) == (3, 0)
    packed = {n: getattr(layer, n) for n in dense}
    assert packed_f32.code_format(packed["down"]) == "q8"
    values = [packed["q"], packed["up"]]
    assert all(p.dtype is torch.float32 for p in values)
    assert len({p.untyped_storage().data_ptr() for p in values}) == 1
    assert packed["down"].untyped_storage().data_ptr() != values[0].untyped_storage().data_ptr()
    alone = {n: packed_f32.pack(w) for n, w in dense.items()}
    for n in dense:
        assert torch.equal(packed[n], alone[n]), n
    big = packed_f32.pack(dense["up"], codes=False)
    if huge_pages.available():
        assert min(p.data_ptr() for p in values) % huge_pages.HUGE_PAGE == 0
        assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    x = {k: torch.randn(5, k, generator=gen) for k in (576, 1536)}
    for n in dense:
        xi = x[dense[n].shape[1]]
        assert torch.equal(packed_f32.linear(xi, packed[n]), packed_f32.linear(xi, alone[n]))
    # Without codes every weight is values, all in the arena.
    plain = torch.nn.Module()
    plain.down = torch.nn.Parameter(dense["down"].clone(), requires_grad=False)
    assert packed_f32.pack_in_place(plain, ("down",), codes=False) == (1, 0)
    assert plain.down.dtype is torch.float32
    assert torch.equal(plain.down, packed_f32.pack(dense["down"], codes=False))


def test_bad_arguments_are_refused() -> None:
    packed = packed_f32.pack(_q8_0(32, 64, seed=2))
    with pytest.raises(RuntimeError, match="columns"):
        packed_f32.linear(torch.zeros(2, 32), packed)
    with pytest.raises(RuntimeError, match="float32"):
        packed_f32.linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="pack_f32_codes"):
        torch.ops.preempt_serve.linear_f32_codes(torch.zeros(2, 64), packed[:, :, :100])


def test_smollm2s_weights_are_its_gguf_codes(smollm2_path: Path) -> None:
    # The embedded SmolLM2 is a Q4_1 GGUF with a Q8_0 embedding (tied to the
    # lm_head): a runner packs every projection as 4-bit codes and the head
    # as 8-bit ones, and its products are the float32 weights' bits.
    from engine.runner import ModelRunner
    from engine.weights import iter_weights

    def runner(codes: bool) -> ModelRunner:
        # Deterministic: the stats see the head's codes through its tiles.
        return ModelRunner(smollm2_path, "float32", "cpu", num_blocks=8, block_size=4,
                           max_model_len=32, num_threads=1, pack_projections="f32_fma",
                           weight_codes=codes, deterministic=codes)

    model, plain_model = runner(True).model, runner(False).model
    assert model.weight_codes() == {"q4": 4 * 30} and plain_model.weight_codes() == {}
    for layer in model.layers:
        for name in model.projection_names:
            assert packed_f32.code_format(getattr(layer, name)) == "q4"
    want = {"model.layers.7.mlp.down_proj.weight", "model.embed_tokens.weight"}
    plain = {name: w for name, w in iter_weights(smollm2_path) if name in want}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1536, generator=gen)
    assert torch.equal(model.linear(x, model.layers[7].down),
                       packed_f32.linear(x, packed_f32.pack(
                           plain["model.layers.7.mlp.down_proj.weight"].float(), codes=False)))
    head = model.head_weight()
    assert head is not None and torch.equal(head, plain["model.embed_tokens.weight"].float())
    h = torch.randn(5, 576, generator=gen)
    assert torch.equal(model.head_linear(h, head),
                       packed_f32.linear(h, packed_f32.pack(head, codes=False)))
    assert model.weight_codes() == {"q4": 4 * 30, "q8": 1}  # the head's, once used
    logits, dense_logits = model.compute_logits(h), plain_model.compute_logits(h)
    assert logits is not None and dense_logits is not None
    assert torch.equal(logits, dense_logits)
