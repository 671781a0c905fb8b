"""The CPU operators around a Llama layer's matmuls: SiLU(gate) * up over one
GEMM's output of both, the residual sum with the norm after it, and the
write of a step's K/V into the paged cache.  Each gives the bits of the ATen
ops it replaces (float32 SiLU × up within four units in the last place, where
ATen and our builds take exp from different libraries); the model gives the
same tokens with them as without them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.attention_cpp as cpp
from engine.models import llama
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.helpers import drive, random_prompts

HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
pytestmark = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
ops = torch.ops.preempt_serve


@pytest.fixture(autouse=True)
def _loaded() -> None:
    cpp.load_kernel()


def _gate_up(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    y = (torch.randn(rows, 2 * n, generator=gen) * 4).to(dtype)
    # exp(-x) past float32's range both ways, and NaN.
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -100.0, 100.0, -0.0])
    y[0, : min(n, 6)] = specials[: min(n, 6)].to(dtype)
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,n", [(1, 5), (3, 16), (7, 37), (96, 1536)])
def test_silu_mul_is_the_op_by_op_product(dtype: torch.dtype, rows: int, n: int) -> None:
    y = _gate_up(rows, n, dtype, seed=n)
    gate, up = y.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_mul(y)
    assert got.shape == (rows, n) and got.dtype == dtype
    same_nan = got.isnan() == want.isnan()
    assert bool(same_nan.all())
    avx2_f32 = cpp.silu_mul_vectorized(dtype) and not cpp.vectorized()
    if (dtype is torch.bfloat16 and cpp.vectorized()) or (avx2_f32 and n % 16 == 0):
        # SLEEF's exp, as ATen's vectorized SiLU: bit for bit (in float32 on
        # AVX2 where ATen's loop has no scalar tail: rows of whole pairs of
        # eight-lane vectors).
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    elif dtype is torch.float32:
        # ATen takes a tail's exp from libm, a vector's from SLEEF; builds
        # with neither AVX512 nor AVX2 take every exp from libm.  Two exps each within one
        # unit in the last place, then the division and the multiply by `up`
        # with their roundings: four units of the product apart at most (four
        # seen on an AVX2 core).
        assert int(_ulps_apart(got, want).max()) <= 4
    else:
        torch.testing.assert_close(got.nan_to_num(0.0).float(), want.nan_to_num(0.0).float(),
                                   rtol=2 ** -7, atol=0.0)


@pytest.mark.parametrize("by_table", [True, False])
def test_every_bf16_gate_gives_atens_silu(by_table: bool) -> None:
    if not ops.set_silu_by_table(by_table):
        pytest.skip("bf16 SiLU × up runs in vectors (by table) on AVX512 builds only")
    # The AVX512 build looks silu(gate) up in a table of all 65,536 bf16
    # gates, or computes it (the switch, for studies): each gate times a
    # random up, both ways, in rows of 128 and in rows of 37 (a tail).
    try:
        gates = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int16).view(torch.bfloat16)
        gen = torch.Generator().manual_seed(0)
        ups = (torch.randn(gates.numel(), generator=gen) * 4).to(torch.bfloat16)
        gate, up = gates.view(-1, 128), ups.view(-1, 128)
        got = ops.silu_mul(torch.cat([gate, up], dim=1))
        tail = ops.silu_mul(torch.cat([gate[:, :37], up[:, :37]], dim=1))
    finally:
        ops.set_silu_by_table(True)
    want = F.silu(gate) * up
    assert bool((got.isnan() == want.isnan()).all())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert torch.equal(tail.nan_to_num(0.0), want[:, :37].nan_to_num(0.0))


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 values lie between `a` and `b`, element-wise (NaN as 0)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.nan_to_num(0.0).view(torch.int32).to(torch.int64)
        # Negative floats' bit patterns run backwards: fold them below zero.
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()


def test_silu_mul_rows_do_not_depend_on_the_batch() -> None:
    y = _gate_up(9, 40, torch.bfloat16, seed=3)
    assert torch.equal(ops.silu_mul(y)[2:5], ops.silu_mul(y[2:5]))


def test_silu_mul_refuses_an_odd_row() -> None:
    with pytest.raises(RuntimeError, match="silu_mul"):
        ops.silu_mul(torch.zeros(2, 7, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows,n", [(1, 576), (96, 576), (5, 10)])
def test_add_norm_is_the_sum_then_the_norm(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, n, generator=gen) * 3).bfloat16()
    wide = (torch.randn(rows, n + 8, generator=gen)).bfloat16()
    r = wide[:, 8:]  # strided rows, as a slice of a wider output
    w = (torch.rand(n, generator=gen) + 0.5).bfloat16()
    total, normed = ops.add_rms_norm_bf16(x, r, w, 1e-5)
    assert torch.equal(total, x + r)
    assert torch.equal(normed, ops.rms_norm_bf16(x + r, w, 1e-5))
    # The layer's helper takes the operator, for bf16 and for float32.
    assert torch.equal(llama.add_rms_norm_cpu(x, r, w, 1e-5)[1], normed)
    xf, rf, wf = x.float() * 1.3, r.float(), w.float()
    sf, nf = llama.add_rms_norm_cpu(xf, rf, wf, 1e-5)
    assert torch.equal(sf, xf + rf) and torch.equal(nf, ops.rms_norm_f32(xf + rf, wf, 1e-5))
    assert torch.equal(ops.add_rms_norm_f32(xf, rf, wf, 1e-5)[1], nf)
    torch.testing.assert_close(nf, llama.rms_norm(xf + rf, wf, 1e-5), rtol=4e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="x's dtype"):
        ops.add_rms_norm_f32(xf, r, wf, 1e-5)


def test_write_kv_writes_what_index_copy_writes() -> None:
    gen = torch.Generator().manual_seed(0)
    kvh, d, t = 3, 64, 10
    # k contiguous (rotated), v a view of the fused qkv output, as the layer has them.
    qkv = torch.randn(t, 9 * d + 2 * kvh * d, generator=gen).bfloat16()
    k = qkv[:, 9 * d : (9 + kvh) * d].contiguous().view(t, kvh, d)
    v = qkv[:, (9 + kvh) * d :].view(t, kvh, d)
    key_cache = torch.zeros(64, 16, kvh, d, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(64 * 16, generator=gen)[:t]
    want_k, want_v = key_cache.clone(), value_cache.clone()
    want_k.view(-1, kvh, d).index_copy_(0, slots, k)
    want_v.view(-1, kvh, d).index_copy_(0, slots, v)
    ops.write_kv(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def test_write_kv_checks_every_slot_before_writing() -> None:
    k = torch.ones(2, 1, 8)
    key_cache, value_cache = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.write_kv(k, k, key_cache, value_cache, torch.tensor([1, 8]))
    assert not key_cache.any() and not value_cache.any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tokens_are_those_of_the_op_by_op_layer(
    tiny_llama_d32_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model with the operators and with ATen's ops in their place
    (the KV write, SiLU * up, the residual sums): the same greedy tokens,
    with chunked prompts and decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts([5, 23, 41, 17], seed=2)

    def run() -> dict[str, list[int]]:
        runner = ModelRunner(tiny_llama_d32_path, dtype, "cpu", num_blocks=96, block_size=4,
                             max_model_len=80, num_threads=1, pack_projections="never")
        return drive(runner, prompts, params, num_blocks=96, block_size=4,
                     max_model_len=80, max_batch_tokens=24).tokens

    fused = run()
    monkeypatch.setattr(cpp, "vectorized", lambda: False)
    monkeypatch.setattr(cpp, "_token_rows", lambda t: False)
    monkeypatch.setattr(llama.LlamaForCausalLM, "_add_norm", _op_by_op_add_norm)
    assert run() == fused


def _op_by_op_add_norm(self: llama.LlamaForCausalLM, x: torch.Tensor, r: torch.Tensor,
                       weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + r
    return x, self.norm_fn(x, weight, self.eps)
