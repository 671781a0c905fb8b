"""Deterministic mode: projections and attention whose result for a token
does not depend on the tokens beside it, and so a request's tokens that do
not depend on what shares its steps, on chunking, on preemption, swap or
recompute, in bfloat16 as in float32.

Each comparison is against our own engine running the same request alone,
under the same dtype, bit for bit."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.attention_cpp as cpp
from engine.attention import SeqSpan, get_attention_backend
from engine.models import packed_bf16, packed_f32, prepacked
from engine.models.batch_invariant import TILE_ROWS, TiledLinear
from engine.models.linear import linear_for, native_low_precision_cpu
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.tier import LocalHostTier
from scheduler.plan import Plan
from tests.engine.helpers import drive, random_prompts

HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
CPU = torch.device("cpu")


@pytest.fixture
def num_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# Projections -------------------------------------------------------------


@pytest.mark.parametrize("num_threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["linear", "prepacked"])
def test_tiled_rows_do_not_depend_on_their_neighbours(
    num_threads: int, dtype: torch.dtype, kind: str
) -> None:
    if kind == "prepacked" and not prepacked.available(dtype, CPU):
        pytest.skip(f"no prepacked linear for {dtype}")
    inner = prepacked.PrepackedLinear() if kind == "prepacked" else linear_for(dtype, CPU)
    fn = TiledLinear(inner)
    gen = torch.Generator().manual_seed(0)
    # SmolLM2's MLP shape; 5,000 output rows cross the slicing of big weights.
    for out_features, in_features in ((1536, 576), (5000, 64)):
        w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
        b = torch.randn(out_features, generator=gen).to(dtype)
        x = torch.randn(2 * TILE_ROWS + 7, in_features, generator=gen).to(dtype)
        alone = torch.cat([fn(x[i : i + 1], w, b) for i in range(x.shape[0])])
        for start, n in ((0, x.shape[0]), (3, TILE_ROWS - 1), (5, TILE_ROWS + 1),
                         (0, TILE_ROWS), (40, 2), (1, 7)):
            assert torch.equal(fn(x[start : start + n], w, b), alone[start : start + n]), (
                out_features, start, n)
        # And it is the product, to the dtype's precision.
        tol = 1e-5 if dtype is torch.float32 else 2e-2
        torch.testing.assert_close(alone.float(), F.linear(x.float(), w.float(), b.float()),
                                   rtol=tol, atol=tol)
    assert fn(x[:0], w, b).shape == (0, w.shape[0])


def test_tile_rows_are_checked() -> None:
    with pytest.raises(ValueError, match="rows must be >= 1"):
        TiledLinear(F.linear, rows=0)


# Attention ---------------------------------------------------------------


def _step(backend, q, k, v, caches, spans):  # type: ignore[no-untyped-def]
    md = backend.build_metadata(spans)
    return backend.forward(q, k, v, caches[0], caches[1], md, 0.125)


# The Triton kernel only where it is compiled: the interpreter's dot rounds a
# row by its place in the tile (tests/engine/test_matmul_triton.py).
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("backend_name,n,rows", [
    pytest.param("cpp", 23, None, marks=needs_cxx),
    pytest.param("triton", 23, None, marks=[pytest.mark.gpu, ON_CUDA]),
    # Contexts of several key tiles.
    pytest.param("triton", 300, None, marks=[pytest.mark.gpu, ON_CUDA]),
    # Query tiles of 21 tokens (engine/attention_triton.py, DETERMINISTIC_ROWS).
    pytest.param("triton", 300, 64, marks=[pytest.mark.gpu, ON_CUDA]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_position_attends_the_same_prefilled_chunked_or_decoded(
    backend_name: str, n: int, rows: int | None, dtype: torch.dtype
) -> None:
    if backend_name == "cpp" and dtype is torch.bfloat16:
        pytest.skip("the C++ operator's float32 case covers its code path")
    heads, kv_heads, dim, bs = 9, 3, 64, 4  # SmolLM2's heads, small blocks
    dev = torch.device("cuda") if backend_name == "triton" else CPU
    backend = get_attention_backend(backend_name)(
        heads, kv_heads, dim, bs, dev, deterministic=True,
        **({} if rows is None else {"deterministic_rows": rows}))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, dim, generator=gen).to(dev, dtype)
    k = torch.randn(n, kv_heads, dim, generator=gen).to(dev, dtype)
    v = torch.randn(n, kv_heads, dim, generator=gen).to(dev, dtype)
    # A neighbour sequence decoding beside it in some of the steps.
    qo = torch.randn(1, heads, dim, generator=gen).to(dev, dtype)
    ko = torch.randn(1, kv_heads, dim, generator=gen).to(dev, dtype)
    vo = torch.randn(1, kv_heads, dim, generator=gen).to(dev, dtype)
    nb = -(-n // bs)

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (2 * nb + 2, bs, kv_heads, dim)
        return (torch.zeros(shape, device=dev, dtype=dtype),
                torch.zeros(shape, device=dev, dtype=dtype))

    # Whole prompt in one step, on the first blocks.
    whole = _step(backend, q, k, v, fresh(), [SeqSpan(0, n, list(range(nb)))])

    # Chunks on other blocks, each step led by the neighbour's decode.
    caches = fresh()
    table = (torch.randperm(nb, generator=gen) + nb + 2).tolist()
    other = [nb, nb + 1]
    parts = []
    cuts = sorted({0, 10, 17, n // 2, n})
    for lo, hi in zip(cuts, cuts[1:]):
        out = _step(backend, torch.cat([qo, q[lo:hi]]), torch.cat([ko, k[lo:hi]]),
                    torch.cat([vo, v[lo:hi]]), caches,
                    [SeqSpan(5, 1, other), SeqSpan(lo, hi - lo, table)])
        parts.append(out[1:])
    chunked = torch.cat(parts)

    # One position per step, as decodes of a batch of two.
    caches = fresh()
    decoded = []
    for p in range(n):
        out = _step(backend, torch.cat([qo, q[p : p + 1]]), torch.cat([ko, k[p : p + 1]]),
                    torch.cat([vo, v[p : p + 1]]), caches,
                    [SeqSpan(5, 1, other), SeqSpan(p, 1, table)])
        decoded.append(out[1:])
    decoded_t = torch.cat(decoded)

    assert torch.equal(whole, chunked)
    assert torch.equal(whole, decoded_t)
    # And it is causal attention.
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        is_causal=True, scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(whole.float(), ref, rtol=tol, atol=tol)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_prompt_position_attends_the_same_however_its_prompt_is_cut(
    dtype: torch.dtype
) -> None:
    # Prompt positions (below the span's prompt_len) go through the prefill
    # operator: whole, in chunks beside other work, or one per step, a
    # position's attention is the same bits; later positions (decoded, then
    # recomputed) through the decode operator, as the same decodes.
    heads, kv_heads, dim, bs = 9, 3, 64, 4
    backend = get_attention_backend("cpp")(heads, kv_heads, dim, bs, CPU, deterministic=True)
    if backend.prefill_kernel is None:
        pytest.skip("no prefill operator on this build: every position takes the decode one")
    n, prompt = 75, 60  # several key tiles of the prefill operator
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, dim, generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    qo, ko, vo = (torch.randn(1, h, dim, generator=gen).to(dtype)
                  for h in (heads, kv_heads, kv_heads))
    nb = -(-n // bs)

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (2 * nb + 2, bs, kv_heads, dim)
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    # The prompt whole, then its answer's positions decoded one per step.
    caches = fresh()
    table = list(range(nb))
    ref = [_step(backend, q[:prompt], k[:prompt], v[:prompt], caches,
                 [SeqSpan(0, prompt, table, prompt)])]
    for p in range(prompt, n):
        ref.append(_step(backend, q[p : p + 1], k[p : p + 1], v[p : p + 1], caches,
                         [SeqSpan(p, 1, table, prompt)]))
    whole = torch.cat(ref)
    # Recomputed after a preemption: prompt and answer in uneven chunks, on
    # other blocks, each step led by another sequence's decode.
    caches = fresh()
    table = (torch.randperm(nb, generator=gen) + nb + 2).tolist()
    other = [nb, nb + 1]
    parts = []
    cuts = [0, 1, 2, 33, 59, 61, 70, n]
    for lo, hi in zip(cuts, cuts[1:]):
        out = _step(backend, torch.cat([qo, q[lo:hi]]), torch.cat([ko, k[lo:hi]]),
                    torch.cat([vo, v[lo:hi]]), caches,
                    [SeqSpan(5, 1, other, 3), SeqSpan(lo, hi - lo, table, prompt)])
        parts.append(out[1:])
    assert torch.equal(torch.cat(parts), whole)
    ref_attn = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        is_causal=True, scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(whole.float(), ref_attn, rtol=tol, atol=tol)


@needs_cxx
def test_deterministic_metadata_splits_prompt_and_later_positions() -> None:
    backend = get_attention_backend("cpp")(6, 2, 32, 4, CPU, deterministic=True)
    if backend.prefill_kernel is None:
        pytest.skip("no prefill operator on this build")
    # A decode past its prompt; a recompute chunk from position 2 to 6 of a
    # sequence whose prompt is 4 tokens: 2 and 3 are prompt positions.
    md = backend.build_metadata([SeqSpan(8, 1, [1, 2, 5, 6], 3),
                                 SeqSpan(2, 5, [7, 3, 9], 4)])
    assert md.prefill_rows.tolist() == [1, 2]
    assert md.decode_rows.tolist() == [0, 3, 4, 5]
    assert md.prefill_block_ids.tolist() == [7]
    assert md.prefill_query_starts.tolist() == [0, 2]
    assert md.prefill_start_positions.tolist() == [2]
    assert md.decode_context_lens.tolist() == [9, 5, 6, 7]
    assert md.decode_block_ids.tolist() == [1, 2, 5, 7, 3]
    assert md.decode_table_starts.tolist() == [0, 3, 3, 3]
    # No prompt position in the step: every token to the decode operator.
    md = backend.build_metadata([SeqSpan(8, 1, [1, 2, 5, 6], 3)])
    assert md.prefill_rows is None and md.num_decodes == 1
    # Decodes past their prompts: the default mode's metadata, field by field.
    spans = [SeqSpan(8, 1, [1, 2, 5, 6], 3), SeqSpan(4, 1, [7, 3], 4), SeqSpan(0, 1, [9], 0)]
    default = get_attention_backend("cpp")(6, 2, 32, 4, CPU)
    md, want = backend.build_metadata(spans), default.build_metadata(spans)
    for field in ("slot_mapping", "decode_block_ids", "decode_table_starts",
                  "decode_context_lens"):
        assert torch.equal(getattr(md, field), getattr(want, field)), field
    assert md.decode_block_ids.tolist() == [1, 2, 5, 7, 3, 9]
    assert md.num_decodes == 3 and md.prefill_rows is None and not md.prefills
    # A one-token chunk at its prompt's last position is a prompt row.
    md = backend.build_metadata([SeqSpan(8, 1, [1, 2, 5, 6], 3), SeqSpan(3, 1, [7], 4)])
    assert md.prefill_rows.tolist() == [1] and md.decode_rows.tolist() == [0]


@needs_cxx
def test_deterministic_metadata_lists_every_token() -> None:
    backend = get_attention_backend("cpp")(6, 2, 16, 4, CPU, deterministic=True)
    md = backend.build_metadata([SeqSpan(8, 1, [1, 2, 5, 6]), SeqSpan(2, 3, [7, 3, 9])])
    assert md.num_decodes == 4 and md.prefills == []
    assert md.decode_block_ids.tolist() == [1, 2, 5, 7, 3]
    assert md.decode_table_starts.tolist() == [0, 3, 3, 3]
    assert md.decode_context_lens.tolist() == [9, 3, 4, 5]
    assert md.slot_mapping.tolist() == [5 * 4, 7 * 4 + 2, 7 * 4 + 3, 3 * 4]
    with pytest.raises(ValueError, match="must precede"):
        backend.build_metadata([SeqSpan(0, 2, [1]), SeqSpan(3, 1, [2])])
    with pytest.raises(ValueError, match="cannot hold"):
        backend.build_metadata([SeqSpan(0, 9, [1, 2])])


def test_only_a_batch_invariant_backend_runs_deterministic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("torch", "compiled"):
        with pytest.raises(ValueError, match=f"'{name}' is not batch-invariant"):
            get_attention_backend(name)(4, 2, 16, 4, CPU, deterministic=True)

    def no_build() -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    # No silent fall-back to the reference path, which is not invariant.
    monkeypatch.setattr(cpp, "load_kernel", no_build)
    with pytest.raises(RuntimeError, match="deterministic mode needs the C\\+\\+"):
        get_attention_backend("cpp")(4, 2, 16, 4, CPU, deterministic=True)


# Whole requests ----------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
BS = 4


def _alone(runner: ModelRunner, prompts: dict[str, list[int]],
           params: SamplingParams) -> dict[str, list[int]]:
    """Each request on its own, its prompt in one chunk: the reference."""
    return {j: drive(runner, {j: p}, params, num_blocks=96, block_size=BS, max_model_len=80,
                     max_batch_tokens=512).tokens[j]
            for j, p in prompts.items()}


@needs_cxx
@pytest.mark.parametrize("model,dtype,pack", [
    ("tiny_llama_path", "bfloat16", "never"),
    ("tiny_llama_path", "float32", "never"),
    # Projections on oneDNN-packed weights, in fixed tiles.
    ("tiny_llama_path", "float32", "always"),
    ("tiny_llama_path", "bfloat16", "always"),
    # Projections on our VDPBF16PS kernel, which needs no tiles.
    ("tiny_llama_path", "bfloat16", "bf16_dot"),
    ("tiny_opt_path", "bfloat16", "auto"),
    # Heads of 32: prompt positions through the prefill operator where it is built.
    ("tiny_llama_d32_path", "bfloat16", "never"),
    ("tiny_llama_d32_path", "float32", "never"),
    # And the projections on our AVX2 FMA kernel (no tiles): what `auto` runs
    # in float32 on an AVX2 CPU.
    ("tiny_llama_d32_path", "float32", "f32_fma"),
    # Prompt positions through the prefill operator inside the one-operator
    # layers (engine/csrc/decode_layer.cpp) on our bf16 kernel.
    ("tiny_llama_d32_path", "bfloat16", "bf16_dot"),
])
def test_tokens_do_not_depend_on_the_batch_chunks_or_preemption(
    model: str, dtype: str, pack: str, request: pytest.FixtureRequest
) -> None:
    if pack == "always" and not prepacked.available(getattr(torch, dtype), CPU):
        pytest.skip(f"no oneDNN packed linear for {dtype} here")
    if pack == "bf16_dot" and not packed_bf16.built():
        pytest.skip("no AVX512-BF16 build of the operators here")
    if pack == "f32_fma" and not packed_f32.built():
        pytest.skip("no AVX2 FMA build of the operators here")
    path = request.getfixturevalue(model)
    runner = ModelRunner(path, dtype, "cpu", num_blocks=96, block_size=BS, max_model_len=80,
                         num_threads=1, deterministic=True,
                         pack_projections=pack)  # type: ignore[arg-type]
    expected = {"never": "none", "always": "onednn", "bf16_dot": "bf16_dot",
                "f32_fma": "f32_fma"}.get(pack)
    assert expected is None or runner.model.packing == expected
    if pack == "bf16_dot":
        assert packed_bf16.is_packed(runner.model.layers[0].qkv)
    if pack == "f32_fma":
        assert packed_f32.is_packed(runner.model.layers[0].qkv)
    prompts = random_prompts([5, 23, 41, 60, 1, 17, 33], seed=1)
    for params in (GREEDY, SEEDED):
        alone = _alone(runner, prompts, params)
        # All together: 24-token chunks, and too few blocks, so that jobs
        # are preempted and recomputed, some part-way through their prompt.
        together = drive(runner, prompts, params, num_blocks=20, block_size=BS,
                         max_model_len=80, max_batch_tokens=24)
        assert together.num_mid_generation_preemptions > 0
        assert together.num_mid_prompt_preemptions > 0
        assert together.tokens == alone, params
    # The same with swapping to a host tier instead of recompute.
    tier = LocalHostTier(capacity_bytes=10**8)
    runner.set_kv_tier(tier)
    try:
        swapped = drive(runner, prompts, GREEDY, num_blocks=20, block_size=BS,
                        max_model_len=80, max_batch_tokens=24, swap_mode="reactive",
                        host_kv_blocks=64)
        assert swapped.core is not None
        runner.execute(Plan(0, [], block_ops=swapped.core.swap.take_pending()))
    finally:
        runner.swapper = None
    assert swapped.core.swap.num_swap_in > 0
    assert swapped.tokens == _alone(runner, prompts, GREEDY)


# Where the CPU has no native bf16 the engine computes bfloat16 in float32
# (engine/models/linear.py), the path the tiny models' bfloat16 cases above
# take there too; at SmolLM2's size that is 20 s of emulation, left to the
# long run (-m slow) on such CPUs.
@(pytest.mark.usefixtures() if native_low_precision_cpu(torch.bfloat16) else pytest.mark.slow)
@needs_cxx
def test_smollm2_bfloat16_tokens_do_not_depend_on_the_batch(smollm2_path: Path) -> None:
    runner = ModelRunner(smollm2_path, "bfloat16", "cpu", num_blocks=96, block_size=BS,
                         max_model_len=80, num_threads=1, deterministic=True)
    gen_prompts = random_prompts([9, 30, 21, 2], seed=3, vocab=20000)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = _alone(runner, gen_prompts, params)
    together = drive(runner, gen_prompts, params, num_blocks=14, block_size=BS,
                     max_model_len=48, max_batch_tokens=16)
    assert together.num_preemptions > 0
    assert together.tokens == alone
