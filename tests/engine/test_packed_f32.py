"""The float32 projections' GEMM on AVX2 FMA (engine/csrc/gemm_f32.cpp).

Runs wherever the operators' library builds with AVX2 and FMA (AVX512
builds include it); skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models import packed_f32, prepacked
from engine.models.batch_invariant import TiledLinear

pytestmark = pytest.mark.skipif(not packed_f32.built(),
                                reason="no AVX2 FMA build of the C++ operators here")


def _xwb(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5,
            torch.randn(n, generator=gen))


def _within_a_float32_chain(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                            b: torch.Tensor | None) -> None:
    # One FMA chain over K (each step rounds once), then the bias: at most
    # about (K + 1) float32 roundings of the magnitudes summed.
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    mags = F.linear(x.double().abs(), w.double().abs(),
                    None if b is None else b.double().abs())
    bound = mags * (x.shape[1] + 2) * 2.0**-24 + 1e-30
    assert y.dtype is torch.float32 and y.shape == exact.shape
    assert bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("m,n,k", [
    (1, 16, 1), (5, 48, 3), (6, 16, 64), (7, 96, 576), (32, 960, 576),
    # Several row chunks (30 rows each at K = 1,536) and a short last one.
    (97, 48, 1536),
])
def test_products_are_one_fma_chain_from_the_exact_sum(m: int, n: int, k: int) -> None:
    x, w, b = _xwb(m, n, k, seed=m + 3 * n + k)
    wp = packed_f32.pack(w)
    assert packed_f32.is_packed(wp) and tuple(wp.shape) == (n // 16, k, 16)
    _within_a_float32_chain(packed_f32.linear(x, wp), x, w, None)
    _within_a_float32_chain(packed_f32.linear(x, wp, b), x, w, b)
    assert packed_f32.linear(x[:0], wp).shape == (0, n)


def test_a_row_does_not_depend_on_its_neighbours_its_block_or_the_threads() -> None:
    x, w, b = _xwb(45, 1024, 576, seed=11)
    wp = packed_f32.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([packed_f32.linear(x[i : i + 1], wp, b) for i in range(45)])
        together = packed_f32.linear(x, wp, b)
        torch.set_num_threads(2)
        assert torch.equal(packed_f32.linear(x, wp, b), together)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    shuffled = torch.randperm(45, generator=torch.Generator().manual_seed(0))
    assert torch.equal(packed_f32.linear(x[shuffled], wp, b), together[shuffled])
    # Strided rows (a slice of a wider tensor) give the same bits.
    wide = torch.zeros(45, 600)
    wide[:, 10:586] = x
    assert torch.equal(packed_f32.linear(wide[:, 10:586], wp, b), together)
    # Deterministic mode's tiles leave such a weight to the kernel as it is.
    tiled = TiledLinear(prepacked.packed_linear, rows=32)
    assert torch.equal(tiled(x[:9], wp, b), together[:9])
    assert torch.equal(TiledLinear(prepacked.PrepackedLinear("f32_fma"), rows=32)(x[:9], w, b),
                       together[:9])


def test_what_the_layout_cannot_take_is_refused_or_left_plain() -> None:
    with pytest.raises(RuntimeError, match="multiple of 16"):
        packed_f32.pack(torch.zeros(40, 8))
    wp = packed_f32.pack(torch.zeros(32, 8))
    with pytest.raises(RuntimeError, match="columns"):
        packed_f32.linear(torch.zeros(2, 10), wp)
    with pytest.raises(RuntimeError, match="float32"):
        packed_f32.linear(torch.zeros(2, 8, dtype=torch.bfloat16), wp)
    layer = torch.nn.Module()
    layer.up = torch.nn.Parameter(torch.randn(32, 8), requires_grad=False)
    layer.odd = torch.nn.Parameter(torch.randn(40, 8), requires_grad=False)
    layer.bf16 = torch.nn.Parameter(torch.randn(32, 8).bfloat16(), requires_grad=False)
    dense_odd = layer.odd.detach().clone()
    assert packed_f32.pack_in_place(layer, ("up", "odd", "bf16")) == (1, 2)
    assert packed_f32.is_packed(layer.up) and not packed_f32.is_packed(layer.odd)
    x = torch.randn(3, 8)
    assert torch.equal(prepacked.packed_linear(x, layer.odd), F.linear(x, dense_odd))
    # What reads a projection's shape (LoRA's check) sees through the layout.
    assert prepacked.projection_shape(layer.up) == (32, 8)
    assert prepacked.projection_shape(layer.odd) == (40, 8)


def test_the_runner_packs_projections_and_head_for_the_kernel(tiny_llama_path: Path) -> None:
    from engine.runner import ModelRunner

    def runner(pack: str, dtype: str = "float32") -> ModelRunner:
        return ModelRunner(tiny_llama_path, dtype, "cpu", num_blocks=8, block_size=4,
                           max_model_len=32, num_threads=1,
                           pack_projections=pack)  # type: ignore[arg-type]

    fma, plain = runner("f32_fma"), runner("never")
    assert fma.model.packing == "f32_fma" and fma.packing_speedup is None
    layer = fma.model.layers[0]
    assert all(packed_f32.is_packed(getattr(layer, n)) for n in fma.model.projection_names)
    hidden = torch.randn(6, fma.model.config.hidden_size,
                         generator=torch.Generator().manual_seed(0))
    logits, ref = fma.model.compute_logits(hidden), plain.model.compute_logits(hidden)
    assert logits is not None and ref is not None
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    # `auto` takes it in float32 where the CPU's widest vectors are AVX2's, or
    # its AVX-512 runs on 256-bit units (Zen 4).
    cpu = torch.device("cpu")
    assert (runner("auto").model.packing == "f32_fma") == packed_f32.preferred(torch.float32, cpu)
    with pytest.raises(ValueError, match="pack_projections 'f32_fma' needs dtype float32"):
        runner("f32_fma", "bfloat16")


def test_deterministic_auto_takes_the_kernel_with_the_vector_prefill(
        tiny_llama_path: Path, tiny_llama_d32_path: Path) -> None:
    # `auto` turns deterministic mode on where it costs nothing: projections
    # and lm_head on this kernel (no tiles) and prompts on the C++ prefill
    # operator's vector path (head dim 32 here, not 16); off with MKL's
    # weights or the torch attention backend.
    from engine.attention_cpp import prefill_vectorized
    from engine.runner import ModelRunner

    def deterministic(pack: str, backend: str | None = None,
                      path: Path = tiny_llama_d32_path) -> bool:
        return ModelRunner(path, "float32", "cpu", num_blocks=8, block_size=4,
                           max_model_len=32, num_threads=1, deterministic="auto",
                           attention_backend=backend,
                           pack_projections=pack).deterministic  # type: ignore[arg-type]

    assert deterministic("f32_fma") is prefill_vectorized(32, 2)
    assert deterministic("f32_fma", "torch") is False
    assert deterministic("never") is False
    assert deterministic("f32_fma", path=tiny_llama_path) is False
