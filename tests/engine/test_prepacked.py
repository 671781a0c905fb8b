"""oneDNN-packed weights (the lm_head's copy, the projections packed in
place) against F.linear, and the choice to pack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import packed_f32, prepacked

needs_onednn = pytest.mark.skipif(
    not prepacked.available(torch.float32, torch.device("cpu")),
    reason="this torch build has no oneDNN packed linear")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 64, 130])
def test_matches_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=gen)
    w = torch.randn(1000, 48, generator=gen)
    b = torch.randn(1000, generator=gen)
    lin = prepacked.PrepackedLinear()
    torch.testing.assert_close(lin(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_repacks_when_the_weight_changes() -> None:
    # Weights are loaded into the parameters after the model is built; a
    # packed copy of the old values must not outlive them.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=gen)
    w = torch.zeros(64, 32)
    lin = prepacked.PrepackedLinear()
    assert torch.count_nonzero(lin(x, w)) == 0
    w.copy_(torch.randn(64, 32, generator=gen))
    torch.testing.assert_close(lin(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    other = torch.randn(64, 32, generator=gen)
    torch.testing.assert_close(lin(x, other), F.linear(x, other), rtol=1e-5, atol=1e-5)


def test_float32_and_native_bfloat16_on_cpu_are_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.models.linear import native_low_precision_cpu

    cpu = torch.device("cpu")
    # bf16 only where oneDNN multiplies it natively; emulated bf16 is
    # computed in float32 (engine.models.linear), never packed.
    assert prepacked.available(torch.bfloat16, cpu) == (
        prepacked.available(torch.float32, cpu) and native_low_precision_cpu(torch.bfloat16))
    # Both kinds of CPU, whichever this one is.
    f32 = prepacked.available(torch.float32, cpu)
    for native in (True, False):
        monkeypatch.setattr(prepacked, "native_low_precision_cpu", lambda dtype, n=native: n)
        assert prepacked.available(torch.bfloat16, cpu) == (f32 and native)
        assert prepacked.available(torch.float32, cpu) == f32
    assert not prepacked.available(torch.float16, cpu)
    assert not prepacked.available(torch.float32, torch.device("cuda"))
    assert not prepacked.available(torch.bfloat16, torch.device("cuda"))


@pytest.mark.skipif(not prepacked.available(torch.bfloat16, torch.device("cpu")),
                    reason="no native bf16 matmul on this CPU")
def test_packed_bfloat16_multiplies_as_f_linear() -> None:
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Module()
    layer.w = torch.nn.Parameter(torch.randn(300, 64, generator=gen).bfloat16(),
                                 requires_grad=False)
    dense = layer.w.detach().clone()
    assert prepacked.pack_in_place(layer, ("w",)) == 1 and layer.w.dtype is torch.bfloat16
    for rows in (1, 9, 100):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        torch.testing.assert_close(prepacked.packed_linear(x, layer.w).float(),
                                   F.linear(x, dense).float(), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_model_logits_use_the_packed_head() -> None:
    from engine.runner import ModelRunner

    runner = ModelRunner("embedded:smollm2", dtype="float32", device="cpu",
                         num_blocks=8, block_size=16, max_model_len=64)
    model = runner.model
    assert isinstance(model.head_linear, prepacked.PrepackedLinear)
    hidden = torch.randn(5, model.config.hidden_size)
    head = model.embed if model.lm_head is None else model.lm_head
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, head),
                               rtol=1e-4, atol=1e-4)


@needs_onednn
def test_packed_in_place_multiplies_as_f_linear_and_refuses_f_linear() -> None:
    gen = torch.Generator().manual_seed(1)
    layer = torch.nn.Module()
    layer.up = torch.nn.Parameter(torch.randn(96, 40, generator=gen), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(96, generator=gen), requires_grad=False)
    layer.norm = torch.nn.Parameter(torch.randn(40, generator=gen), requires_grad=False)
    dense = layer.up.detach().clone()
    assert prepacked.pack_in_place(layer, ("up", "norm")) == 1  # 1-D `norm` is no matmul
    assert layer.up.is_mkldnn and not layer.norm.is_mkldnn and not layer.bias.is_mkldnn
    for rows in (1, 5, 64, 130):
        x = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(prepacked.packed_linear(x, layer.up, layer.bias),
                                   F.linear(x, dense, layer.bias), rtol=1e-5, atol=1e-5)
    # Transposed (non-contiguous) input rows, and no rows.
    xt = torch.randn(40, 7, generator=gen).t()
    torch.testing.assert_close(prepacked.packed_linear(xt, layer.up), F.linear(xt, dense),
                               rtol=1e-5, atol=1e-5)
    assert prepacked.packed_linear(x[:0], layer.up).shape == (0, 96)
    # A plain weight still goes through F.linear.
    torch.testing.assert_close(prepacked.packed_linear(x, dense), F.linear(x, dense))
    # Whatever reads a packed weight as a plain one fails instead of misreading it.
    with pytest.raises(RuntimeError):
        F.linear(x, layer.up)
    assert prepacked.pack_in_place(layer, ("up",)) == 0  # packed once


def test_auto_packs_only_on_a_clear_win() -> None:
    assert prepacked.should_pack("always", None) and prepacked.should_pack("always", 0.5)
    assert not prepacked.should_pack("never", 3.0)
    assert prepacked.should_pack("auto", prepacked.MIN_SPEEDUP)
    assert prepacked.should_pack("auto", 2.3)
    assert not prepacked.should_pack("auto", 1.05)  # within a shared host's noise
    assert not prepacked.should_pack("auto", None)  # nothing measured


@needs_onednn
def test_runner_packs_the_projections_where_the_probe_says(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    from engine.runner import ModelRunner

    auto = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=8, block_size=4,
                       max_model_len=32, num_threads=1)
    if packed_f32.preferred(torch.float32, torch.device("cpu")):
        # AVX2 or Zen 4: our FMA kernel, no probe (tests/engine/test_packed_f32.py).
        assert auto.packing_speedup is None and auto.model.packing == "f32_fma"
    else:
        assert auto.packing_speedup is not None and auto.packing_speedup > 0
        assert auto.model.packed == (auto.packing_speedup >= prepacked.MIN_SPEEDUP)
        assert auto.model.layers[0].down.is_mkldnn == auto.model.packed
    onednn = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=8, block_size=4,
                         max_model_len=32, num_threads=1, pack_projections="always")
    assert onednn.model.packing == "onednn" and onednn.model.layers[0].down.is_mkldnn
    never = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=8, block_size=4,
                        max_model_len=32, num_threads=1, pack_projections="never")
    assert never.packing_speedup is None and not never.model.packed
    # bfloat16 projections are packed only where the CPU multiplies bf16
    # natively; elsewhere they are computed in float32 (engine.models.linear).
    bf16 = ModelRunner(tiny_llama_path, "bfloat16", "cpu", num_blocks=8, block_size=4,
                       max_model_len=32, num_threads=1, pack_projections="always")
    native = prepacked.available(torch.bfloat16, torch.device("cpu"))
    assert bf16.model.packed == native == bf16.model.layers[0].qkv.is_mkldnn
    with pytest.raises(ValueError, match="pack_projections must be one of"):
        ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=8, block_size=4,
                    max_model_len=32, pack_projections="sometimes")  # type: ignore[arg-type]
