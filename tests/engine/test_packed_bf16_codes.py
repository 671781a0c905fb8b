"""bf16 projections kept with a GGUF weight's codes (engine/csrc/gemm_bf16_codes.cpp).

Runs wherever the operators' library has its AVX512-BF16 build; skipped
elsewhere.  On a CPU with AMX the kernel multiplies the codes at up to 64
rows and the bf16 values beyond; elsewhere (and with the tiles switched off)
the values.  The reference is the bf16 kernel on the packed bf16 weight: the
products must be the same bits, whichever way a call takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import packed_bf16, prepacked, weight_codes
from tests.engine.test_packed_f32_codes import _q4_1, _q8_0

pytestmark = pytest.mark.skipif(not packed_bf16.built(),
                                reason="no AVX512-BF16 build of the C++ operators here")


def _both(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`w`'s codes with its bf16 values, its packed bf16 weight)."""
    codes = weight_codes.fit(w)
    assert codes is not None
    dense = packed_bf16.pack(w.bfloat16())
    return weight_codes.with_values(codes, dense), dense


@pytest.fixture(params=[True, False], ids=["tiles", "vectors"])
def tiles(request: pytest.FixtureRequest):
    """Each test on the AMX tiles (where this CPU has them) and off them."""
    before = packed_bf16.on_tiles()
    if request.param and not packed_bf16.amx(True):
        pytest.skip("no AMX tiles here")
    packed_bf16.amx(request.param)
    yield request.param
    packed_bf16.amx(before)


@pytest.mark.parametrize("make,fmt,block_bytes", [(_q4_1, "q4", 384), (_q8_0, "q8", 576)])
@pytest.mark.parametrize("m,n,k", [
    (1, 16, 32), (5, 48, 576), (16, 960, 576), (33, 48, 1536),
    # Four row tiles (the codes' most), one more row (the values), and many.
    (64, 96, 576), (65, 96, 576), (300, 32, 1536),
])
def test_codes_give_the_bf16_weights_products_bit_for_bit(
        tiles: bool, make, fmt: str, block_bytes: int, m: int, n: int, k: int) -> None:
    w = make(n, k, seed=m + n + k)
    both, dense = _both(w)
    assert weight_codes.code_format(both) == fmt and weight_codes.bf16_codes(both)
    assert not weight_codes.f32_codes(both) and packed_bf16.multiplies(both)
    assert tuple(both.shape) == (n // 16, k // 32, block_bytes + 1024)
    assert prepacked.projection_shape(both) == (n, k)
    assert weight_codes.decodes_to(both, w.bfloat16())
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    assert torch.equal(packed_bf16.linear(x, both), packed_bf16.linear(x, dense))
    assert torch.equal(packed_bf16.linear(x, both, b), packed_bf16.linear(x, dense, b))
    assert torch.equal(prepacked.packed_linear(x, both, b), packed_bf16.linear(x, dense, b))
    assert packed_bf16.linear(x[:0], both).shape == (0, n)


def test_a_row_alone_and_in_any_batch_gets_the_same_bits(tiles: bool) -> None:
    # Alone, a row takes the codes (on the tiles); among 100 rows, the
    # values: the same sums either way, and with two threads.
    both, _ = _both(_q4_1(1024, 576, seed=3))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(100, 576, generator=gen).bfloat16()
    b = torch.randn(1024, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([packed_bf16.linear(x[i : i + 1], both, b) for i in range(100)])
        together = packed_bf16.linear(x, both, b)
        torch.set_num_threads(2)
        assert torch.equal(packed_bf16.linear(x, both, b), together)
        assert torch.equal(packed_bf16.linear(x[:40], both, b), together[:40])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    wide = torch.zeros(100, 600, dtype=torch.bfloat16)
    wide[:, 10:586] = x
    assert torch.equal(packed_bf16.linear(wide[:60, 10:586], both, b), together[:60])


@pytest.mark.parametrize("m,inter,k", [
    # The codes (up to 64 rows), then the fused pass: two row tiles, one,
    # a partial one, and rows across several of x's chunks; a K too deep
    # for the pass (two operators again).
    (1, 48, 576), (64, 64, 576), (65, 64, 576), (96, 1536, 576), (130, 80, 576),
    (300, 32, 704), (1100, 32, 576), (100, 32, 1536),
])
def test_swiglu_on_the_codes_gives_the_two_operators_bits(tiles: bool, m: int, inter: int,
                                                          k: int) -> None:
    # linear_bf16_codes_silu_mul: silu(g) * u of the gate_up projection,
    # fused past 64 rows on the tiles, must be linear_bf16_codes then
    # silu_mul bit for bit, with a bias or none, whichever way it runs, and
    # a row alone the same bits as in the batch.
    ops = torch.ops.preempt_serve
    both, _ = _both(_q4_1(2 * inter, k, seed=m + inter))
    gen = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=gen) * 2).bfloat16()
    b = torch.randn(2 * inter, generator=gen).bfloat16()
    for bias in (None, b):
        want = ops.silu_mul(ops.linear_bf16_codes(x, both, bias))
        assert torch.equal(ops.linear_bf16_codes_silu_mul(x, both, bias), want)
        assert torch.equal(ops.linear_bf16_codes_silu_mul(x[m // 2 : m // 2 + 1], both, bias),
                           want[m // 2 : m // 2 + 1])
    assert ops.set_swiglu_fused(False) == ops.set_swiglu_fused(True)


def test_the_layout_puts_each_lines_codes_where_the_decoder_reads_them() -> None:
    # to_bf16_layout against its definition, code by code.
    w = _q4_1(32, 64, seed=7)
    codes = weight_codes.fit(w)
    assert codes is not None
    d = codes[..., :64].contiguous().view(torch.float32)
    m = codes[..., 64:128].contiguous().view(torch.float32)
    out = weight_codes.to_bf16_layout(codes)
    assert torch.equal(out[..., :128], codes[..., :128])
    lines = out[..., 128:].reshape(2, 2, 16, 16)  # [panel][k block][kp][byte]
    for p, kb, kp, j in [(0, 0, 0, 0), (1, 1, 15, 15), (0, 1, 7, 10), (1, 0, 3, 5)]:
        e, col = j % 2, j // 2
        for half, shift in ((0, 0), (8, 4)):
            q = (int(lines[p, kb, kp, j]) >> shift) & 15
            n, kk = p * 16 + col + half, kb * 32 + 2 * kp + e
            value = d[p, kb, col + half] * q + m[p, kb, col + half]
            assert value.item() == w[n, kk].item()


def test_codes_that_do_not_decode_to_the_weight_are_not_kept() -> None:
    w = _q4_1(32, 64, seed=5)
    codes = weight_codes.fit(w)
    assert codes is not None
    layer = torch.nn.Module()
    off = w.bfloat16()
    off[3, 9] = off[3, 9] * 2 + 1  # no longer the codes' value
    layer.up = torch.nn.Parameter(w.bfloat16(), requires_grad=False)
    layer.off = torch.nn.Parameter(off, requires_grad=False)
    assert packed_bf16.pack_in_place(layer, ("up", "off"), {"up": codes, "off": codes}) == (2, 0)
    # Kept only where they pay (on AMX tiles).
    assert weight_codes.bf16_codes(layer.up) == packed_bf16.codes_pay()
    assert packed_bf16.is_packed(layer.off) and not weight_codes.bf16_codes(layer.off)
    with pytest.raises(RuntimeError, match="pack_bf16_codes"):
        torch.ops.preempt_serve.linear_bf16_codes(torch.zeros(2, 64, dtype=torch.bfloat16),
                                                  codes)
    with pytest.raises(RuntimeError, match="columns"):
        packed_bf16.linear(torch.zeros(2, 32, dtype=torch.bfloat16),
                           weight_codes.with_values(codes, packed_bf16.pack(w.bfloat16())))


def test_a_fused_projection_has_codes_only_where_all_its_parts_do() -> None:
    source = weight_codes.SourceCodes(["layers.0.qkv", "layers.1.qkv", "layers.2.qkv",
                                       "layers.0.o"])
    q, k = _q4_1(32, 64, seed=1), _q4_1(16, 64, seed=2)
    source.add("layers.0.qkv", 0, q)
    source.add("layers.0.qkv", 1, k)
    source.add("layers.1.qkv", 0, q)
    source.add("layers.1.qkv", 1, _q8_0(16, 64, seed=3))  # another format
    source.add("layers.2.qkv", 0, q)
    source.add("layers.2.qkv", 1, torch.randn(16, 64))  # no codes
    source.add("layers.0.o", None, q)
    source.add("layers.0.norm", None, q)  # not a projection
    got = source.finish(lambda param: 2)
    assert set(got) == {"layers.0.qkv", "layers.0.o"}
    whole = weight_codes.fit(torch.cat([q, k]))
    assert whole is not None and torch.equal(got["layers.0.qkv"], whole)


def test_smollm2_in_bf16_keeps_its_projections_codes(smollm2_path: Path) -> None:
    # Every projection of the embedded Q4_1 SmolLM2 is kept with its codes
    # where they pay (AMX tiles), and the greedy tokens are those of the
    # model without them (deterministic mode: no tiles of rows around them).
    from engine.runner import ModelRunner
    from engine.sampling_params import SamplingParams
    from tests.engine.helpers import drive

    def runner(codes: bool) -> ModelRunner:
        return ModelRunner(smollm2_path, "bfloat16", "cpu", num_blocks=64, block_size=4,
                           max_model_len=64, num_threads=1, pack_projections="bf16_dot",
                           weight_codes=codes, deterministic=True)

    with_codes, plain = runner(True), runner(False)
    assert plain.model.weight_codes() == {}
    if not packed_bf16.codes_pay():
        assert with_codes.model.weight_codes() == {}
        pytest.skip("no AMX tiles here: bf16 weights keep no codes")
    assert with_codes.model.weight_codes() == {"q4": 4 * 30}
    assert with_codes.model.source_codes == {}
    # The head (the embedding's Q8_0 codes) once it has been used.
    hidden = torch.randn(3, with_codes.model.config.hidden_size).bfloat16()
    logits = with_codes.model.compute_logits(hidden)
    ref = plain.model.compute_logits(hidden)
    assert logits is not None and ref is not None and torch.equal(logits, ref)
    assert with_codes.model.weight_codes() == {"q4": 4 * 30, "q8": 1}
    tok = with_codes.tokenizer
    prompts = {f"p{i}": tok.encode(t, add_special_tokens=False) for i, t in
               enumerate(["The capital of France is", "def fib(n):", "Once upon a time"])}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {name: drive(r, prompts, params, num_blocks=64, block_size=4, max_model_len=64).tokens
           for name, r in (("codes", with_codes), ("plain", plain))}
    assert got["codes"] == got["plain"]
