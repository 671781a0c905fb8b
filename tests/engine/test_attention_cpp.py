"""The C++ paged decode operator (the prefill operator has its own tests,
test_prefill_cpp.py, also run here in the other builds): that it builds where a compiler exists,
its math on the shapes the fast paths unroll (and on others), its inputs
checked, and its fall-back where it cannot be built."""

from __future__ import annotations

import logging
import shutil
from itertools import accumulate

import pytest
import torch

import engine.attention_cpp as cpp
import engine.cpp_ops as ops
from engine.attention import SeqSpan, default_backend_name, get_attention_backend

HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               tables: list[list[int]], contexts: list[int]) -> torch.Tensor:
    """Dense float64 attention of each query over its context."""
    _, bs, kvh, d = keys.shape
    out = []
    for i, (table, ctx) in enumerate(zip(tables, contexts)):
        k = keys[table].reshape(-1, kvh, d)[:ctx].double()
        v = values[table].reshape(-1, kvh, d)[:ctx].double()
        group = q.shape[1] // kvh
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = (torch.einsum("hd,khd->hk", q[i].double(), k) * d**-0.5).softmax(-1)
        out.append(torch.einsum("hk,khd->hd", p, v))
    return torch.stack(out)


def _case(contexts: list[int], heads: int, kv_heads: int, dim: int, bs: int,
          seed: int = 0, spread: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // bs) for c in contexts) + 5
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in contexts]
    keys = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen) * spread
    values = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    q = torch.randn(len(contexts), heads, dim, generator=gen)
    return q, keys, values, tables


def _call(q, keys, values, tables, contexts):
    ids = torch.tensor([b for t in tables for b in t])
    starts = torch.tensor([0, *accumulate(len(t) for t in tables)][:-1])
    return cpp.load_kernel()(q, keys, values, ids, starts, torch.tensor(contexts),
                             q.shape[-1] ** -0.5)


@needs_cxx
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [
    (9, 3, 64, 16),   # SmolLM2: an unrolled head dim
    (8, 8, 128, 16),  # Llama-7B's head dim, no grouping
    (6, 2, 8, 4),     # a head dim with no unrolled build
    (4, 1, 80, 32),   # a larger block
    (16, 2, 128, 8),  # a group of 8: two tiles of heads in the weighted sum
    (4, 4, 96, 24),   # 16 + 8 tokens a block; the weighted sum in two slices
    (8, 2, 256, 16),  # four slices of the value rows
    (6, 3, 32, 16),   # two vectors a row
    (6, 2, 64, 12),   # blocks not in whole 8s of tokens (AVX2: a part-vector of scores)
])
def test_matches_dense_attention(heads: int, kv_heads: int, dim: int, bs: int) -> None:
    contexts = [1, bs - 1, bs, bs + 1, 5 * bs + 3, 40 * bs + 7]
    q, keys, values, tables = _case(contexts, heads, kv_heads, dim, bs)
    got = _call(q, keys, values, tables, contexts)
    torch.testing.assert_close(got.double(), _reference(q, keys, values, tables, contexts),
                               rtol=2e-5, atol=2e-5)


@needs_cxx
@pytest.mark.parametrize("dim", [16, 64])
def test_online_softmax_keeps_extreme_scores_exact(dim: int) -> None:
    # Keys scaled so that scores span hundreds: the running max changes
    # from block to block and early blocks' weights underflow to zero;
    # the result must stay the dense softmax's.
    contexts = [200, 63, 129]
    q, keys, values, tables = _case(contexts, 4, 2, dim, 8, spread=40.0)
    got = _call(q, keys, values, tables, contexts)
    want = _reference(q, keys, values, tables, contexts)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@needs_cxx
@pytest.mark.parametrize("dim,bs", [(16, 4), (64, 12)])
def test_one_long_context_does_not_change_the_others(dim: int, bs: int) -> None:
    contexts = [3, 9, 300, 7]
    q, keys, values, tables = _case(contexts, 6, 2, dim, bs)
    full = _call(q, keys, values, tables, contexts)
    short = [0, 1, 3]
    part = _call(q[short], keys, values, [tables[i] for i in short],
                 [contexts[i] for i in short])
    assert torch.equal(full[short], part)


@needs_cxx
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [
    (6, 2, 64, 16), (16, 2, 128, 8), (4, 4, 96, 24), (8, 2, 256, 16), (6, 3, 32, 16),
    (4, 2, 16, 4),  # no vectorized build for this head dim
])
def test_bfloat16_cache_accumulates_in_float32(heads: int, kv_heads: int, dim: int,
                                                bs: int) -> None:
    contexts = [3, 40, 100, 31 * bs + 5]
    q, keys, values, tables = _case(contexts, heads, kv_heads, dim, bs)
    got = _call(q.bfloat16(), keys.bfloat16(), values.bfloat16(), tables, contexts)
    assert got.dtype == torch.bfloat16
    want = _reference(q.bfloat16().float(), keys.bfloat16().float(),
                      values.bfloat16().float(), tables, contexts)
    # Only the output's rounding to bf16 separates it from float64.
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=8e-3)


@needs_cxx
def test_threads_split_sequences_without_changing_results() -> None:
    contexts = [5, 70, 33, 1, 120, 16, 48, 9]
    q, keys, values, tables = _case(contexts, 6, 2, 64, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _call(q, keys, values, tables, contexts)
        torch.set_num_threads(2)
        two = _call(q, keys, values, tables, contexts)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_look_ahead_changes_no_value(dtype: torch.dtype) -> None:
    # The look-ahead only prefetches: the same bits with it and without,
    # where the next sequence shares the current one's leading blocks (those
    # it skips) and where a block is shared at another place.
    contexts = [70, 70, 5, 120, 33, 1, 48]
    q, keys, values, tables = _case(contexts, 9, 3, 64, 16)
    tables[1][:3] = tables[0][:3]
    tables[4][1] = tables[3][0]
    args = (q.to(dtype), keys.to(dtype), values.to(dtype), tables, contexts)
    cpp.load_kernel()
    before = ops.decode_lookahead_f32(False)
    try:
        off = _call(*args)
        # The setter answers the setting before it, on a build that has it.
        assert ops.decode_lookahead_f32(True) is False
        on = _call(*args)
        assert ops.decode_lookahead_f32(True) is ops.vectorized()
    finally:
        ops.decode_lookahead_f32(before)
    assert torch.equal(off, on)
    want = _reference(*(t.float() for t in args[:3]), tables, contexts)
    tol = 2e-5 if dtype is torch.float32 else 8e-3
    torch.testing.assert_close(on.double(), want, rtol=tol, atol=tol)


def test_float32_look_ahead_follows_the_cpu_unless_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for zen4 in (False, True):
        monkeypatch.setattr(ops, "avx512_half_width", lambda zen4=zen4: zen4)
        monkeypatch.delenv("PREEMPT_SERVE_F32_LOOKAHEAD", raising=False)
        assert ops._lookahead_f32_wanted() is zen4
        for value in ("0", "1"):
            monkeypatch.setenv("PREEMPT_SERVE_F32_LOOKAHEAD", value)
            assert ops._lookahead_f32_wanted() is (value == "1")
    monkeypatch.setenv("PREEMPT_SERVE_F32_LOOKAHEAD", "yes")
    with pytest.raises(ValueError, match="PREEMPT_SERVE_F32_LOOKAHEAD='yes'"):
        ops._lookahead_f32_wanted()


@needs_cxx
def test_rejects_inputs_it_cannot_read() -> None:
    contexts = [5, 9]
    q, keys, values, tables = _case(contexts, 6, 2, 16, 4)
    ids = torch.tensor([b for t in tables for b in t])
    starts, ctx = torch.tensor([0, len(tables[0])]), torch.tensor(contexts)
    op = cpp.load_kernel()
    with pytest.raises(RuntimeError, match="int64"):
        op(q, keys, values, ids.int(), starts, ctx, 0.25)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q.double(), keys, values, ids, starts, ctx, 0.25)
    with pytest.raises(RuntimeError, match="one table start"):
        op(q, keys, values, ids, starts[:1], ctx, 0.25)
    with pytest.raises(RuntimeError, match="head layout"):
        op(q[:, :5], keys, values, ids, starts, ctx, 0.25)


@needs_cxx
def test_backend_lists_each_decode_table_once() -> None:
    backend = get_attention_backend("cpp")(6, 2, 16, 4, torch.device("cpu"))
    assert backend.kernel is not None
    spans = [SeqSpan(0, 1, [7, 3]), SeqSpan(8, 1, [1, 2, 5, 6]), SeqSpan(3, 1, [4])]
    md = backend.build_metadata(spans)
    # Tables cut to the context (block 3 of the first span is not needed yet).
    assert md.decode_block_ids.tolist() == [7, 1, 2, 5, 4]
    assert md.decode_table_starts.tolist() == [0, 1, 4]
    assert md.decode_context_lens.tolist() == [1, 9, 4]
    assert md.decode_block_tables is None  # no padded copy is built


def test_falls_back_when_the_build_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_build() -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp, "load_kernel", no_build)
    with caplog.at_level(logging.WARNING, logger=cpp.__name__):
        backend = get_attention_backend("cpp")(6, 2, 16, 4, torch.device("cpu"))
    assert backend.kernel is None
    assert "Ninja is required" in caplog.text
    contexts = [6, 11, 25]
    q, keys, values, tables = _case(contexts, 6, 2, 16, 4)
    spans = [SeqSpan(c - 1, 1, t) for c, t in zip(contexts, tables)]
    k_new = torch.stack([keys[t[(c - 1) // 4], (c - 1) % 4] for c, t in zip(contexts, tables)])
    v_new = torch.stack([values[t[(c - 1) // 4], (c - 1) % 4] for c, t in zip(contexts, tables)])
    out = backend.forward(q, k_new, v_new, keys, values, backend.build_metadata(spans), 0.25)
    torch.testing.assert_close(out.double(), _reference(q, keys, values, tables, contexts),
                               rtol=1e-5, atol=1e-5)


def test_build_failure_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    # A machine that cannot build pays for the attempt once per process.
    calls = []

    def failing_load(**kwargs: object) -> None:
        calls.append(kwargs)
        raise OSError("g++: command not found")

    monkeypatch.setattr(ops, "_kernel", None)
    monkeypatch.setattr(ops, "_load_error", None)
    monkeypatch.setattr("torch.utils.cpp_extension.load", failing_load)
    with pytest.raises(RuntimeError, match="command not found"):
        ops.load_kernel()
    attempts = len(calls)
    assert attempts in (1, 2, 3)  # the AMX and bf16 dot builds are tried first where wanted
    with pytest.raises(RuntimeError, match="command not found"):
        ops.load_kernel()
    assert len(calls) == attempts


def _builds_after_a_failure(monkeypatch: pytest.MonkeyPatch, failing_flag: str, amx: bool
                            ) -> list[list[str]]:
    """The flags of every build `load_kernel` tries on an AVX512 CPU with the
    bf16 dot product (and AMX where `amx`) when builds with `failing_flag` fail."""
    real = ops.load_kernel()  # the operator is registered in this process
    calls: list[list[str]] = []

    def load(**kwargs: object) -> None:
        flags = list(kwargs["extra_cflags"])  # type: ignore[call-overload]
        calls.append(flags)
        if failing_flag in flags:
            raise RuntimeError(f"unrecognized command-line option '{failing_flag}'")

    monkeypatch.setattr(ops, "_kernel", None)
    monkeypatch.setattr(ops, "_load_error", None)
    monkeypatch.setattr(ops, "bf16_dot_wanted", lambda: True)
    monkeypatch.setattr(ops, "amx_wanted", lambda: amx)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    assert ops.load_kernel() is real
    return calls


@needs_cxx
def test_a_failed_bf16_dot_build_falls_back_to_the_plain_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=cpp.__name__):
        calls = _builds_after_a_failure(monkeypatch, "-mavx512bf16", amx=False)
    assert ["-mavx512bf16" in c for c in calls] == [True, False]
    assert "_avx512_bf16 failed; trying preempt_serve_paged_decode_avx512" in caplog.text


@needs_cxx
def test_a_failed_amx_build_falls_back_to_the_bf16_dot_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=cpp.__name__):
        calls = _builds_after_a_failure(monkeypatch, "-mamx-tile", amx=True)
    assert [("-mamx-tile" in c, "-mavx512bf16" in c) for c in calls] == [(True, True),
                                                                         (False, True)]
    assert "_bf16_amx failed; trying preempt_serve_paged_decode_avx512_bf16" in caplog.text


needs_amx = pytest.mark.skipif(not (HAS_CXX and cpp.amx_wanted()),
                               reason="no AMX (amx_tile, amx_bf16) on this CPU")


@pytest.fixture
def amx_back_on() -> object:
    # The path is process-wide: later tests get the tiles again.
    yield
    cpp.decode_amx(True)


@needs_amx
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [
    (9, 3, 64, 16),   # SmolLM2: a group of three from the tile by permutes
    (16, 1, 64, 16),  # a group of 16: one tile row per head, gathered
    (12, 2, 64, 48),  # 32-key steps across blocks of 48
    (6, 3, 32, 16),   # one piece per row: half a group of output tiles
    (4, 4, 96, 32),   # three pieces: a second group of two output tiles
    (16, 2, 128, 16),  # four query tiles held
    (8, 2, 256, 16),  # eight pieces: the queries reloaded per piece
])
def test_amx_path_matches_dense_attention_and_the_vector_path(
        heads: int, kv_heads: int, dim: int, bs: int, amx_back_on: object) -> None:
    contexts = [1, 15, 16, 17, 31, 32, 33, bs + 1, 5 * bs + 3, 40 * bs + 7]
    q, keys, values, tables = _case(contexts, heads, kv_heads, dim, bs)
    args = (q.bfloat16(), keys.bfloat16(), values.bfloat16(), tables, contexts)
    assert cpp.decode_amx(True)  # this CPU has AMX: bf16 decodes must take it
    assert torch.ops.preempt_serve.set_decode_value_terms(True)
    try:
        tiles = _call(*args)
        torch.ops.preempt_serve.set_decode_value_terms(False)
        two_terms = _call(*args)
    finally:
        torch.ops.preempt_serve.set_decode_value_terms(True)
    want = _reference(*(t.float() for t in args[:3]), tables, contexts)
    torch.testing.assert_close(tiles.double(), want, rtol=8e-3, atol=8e-3)
    assert not cpp.decode_amx(False)
    vectors = _call(*args)
    # p's two bf16 terms (the switch, for studies) keep the weighted sum at
    # the vector path's accuracy: the two differ by the output's last bf16
    # bit, and rarely (where a sum of terms near 1 cancels to near 0, by
    # what float32 sums leave, ~1e-5).
    diff = (two_terms.float() - vectors.float()).abs()
    assert (diff <= vectors.float().abs() * 2**-7 + 1e-4).all()
    assert (diff > 0).float().mean() < 0.02
    # p rounded once to bf16 (the default, as the prefill operator takes it):
    # 2^-9 of each weight, a little more error against the exact sums, never
    # more than the prefill operator's bound.
    err = lambda got: (got.double() - want).abs()  # noqa: E731
    assert (err(tiles) <= want.abs() * 2**-8 + 5e-3).all()
    assert not torch.equal(tiles, two_terms)
    rel = lambda got: (err(got) / (want.abs() + 1e-3)).median().item()  # noqa: E731
    assert rel(two_terms) <= rel(tiles) < 3 * rel(two_terms) + 1e-4


@needs_amx
@pytest.mark.parametrize("spread", [1.0, 40.0])
def test_amx_short_exponential_rounds_p_as_closely(spread: float, amx_back_on: object) -> None:
    # set_short_exp: the one-term p as 2^(x log2 e) on a degree-4 polynomial
    # (~3e-6 relative) instead of the degree-7 e^x; p is rounded to bf16
    # next, so only p near a rounding boundary lands a bf16 step elsewhere:
    # the same bound against float64, about the same median error, the path
    # switched where the weights spread, and batch invariance kept.
    contexts = [1, 17, 33, 200, 63, 129, 5, 700]
    q, keys, values, tables = _case(contexts, 9, 3, 64, 16, spread=spread)
    q, keys, values = q.bfloat16(), keys.bfloat16(), values.bfloat16()
    assert cpp.decode_amx(True)
    try:
        assert torch.ops.preempt_serve.set_short_exp(False)
        full = _call(q, keys, values, tables, contexts)
        assert torch.ops.preempt_serve.set_short_exp(True)
        short = _call(q, keys, values, tables, contexts)
    finally:
        torch.ops.preempt_serve.set_short_exp(True)
    want = _reference(q.float(), keys.float(), values.float(), tables, contexts)
    err = lambda got: (got.double() - want).abs()  # noqa: E731
    for got in (full, short):
        assert (err(got) <= want.abs() * 2**-8 + 5e-3).all()
    assert spread > 1.0 or not torch.equal(short, full)
    assert (short != full).double().mean() < 0.05
    rel = lambda got: (err(got) / (want.abs() + 1e-3)).median().item()  # noqa: E731
    assert rel(short) < 1.1 * rel(full) + 1e-5
    some = [6, 1, 3]
    part = _call(q[some], keys, values, [tables[i] for i in some], [contexts[i] for i in some])
    assert torch.equal(short[some], part)


@needs_amx
def test_amx_path_keeps_extreme_scores_and_batch_invariance(amx_back_on: object) -> None:
    contexts = [200, 63, 129, 5, 700]
    q, keys, values, tables = _case(contexts, 9, 3, 64, 16, spread=40.0)
    q, keys, values = q.bfloat16(), keys.bfloat16(), values.bfloat16()
    assert cpp.decode_amx(True)
    full = _call(q, keys, values, tables, contexts)
    assert torch.isfinite(full).all()
    want = _reference(q.float(), keys.float(), values.float(), tables, contexts)
    torch.testing.assert_close(full.double(), want, rtol=8e-3, atol=8e-3)
    some = [4, 1, 2]
    part = _call(q[some], keys, values, [tables[i] for i in some], [contexts[i] for i in some])
    assert torch.equal(full[some], part)


_OTHER_BUILDS = {
    # What an AVX512 CPU without avx512_bf16 builds: bf16 keys widened.
    "no-bf16-dot": ({"PREEMPT_SERVE_CPP_BF16_DOT": "0"}, cpp.bf16_dot_wanted()),
    # What an AVX2 CPU builds: float32 decodes and the prefill operator in
    # 8-lane vectors (engine/csrc/paged_decode_avx2.h, paged_prefill_avx2.h),
    # bfloat16 decodes on the portable loop.
    "portable": ({"ATEN_CPU_CAPABILITY": "avx2"},
                 torch.backends.cpu.get_cpu_capability() == "AVX512"),
}


# The checks each other build runs, in a process of its own (one build of the
# operators per process).
_OTHER_BUILD_CHECK = (
    "import torch\n"
    "import engine.attention_cpp as cpp\n"
    "from tests.engine import test_attention_cpp as t, test_logits_cpu as lg\n"
    "from tests.engine import test_prefill_cpp as pf\n"
    "cpp.load_kernel()\n"
    "for shape in [(9, 3, 64, 16), (16, 2, 128, 8), (4, 4, 96, 24), (6, 2, 8, 4),\n"
    "              (6, 2, 64, 12)]:\n"
    "    t.test_matches_dense_attention(*shape)\n"
    "    t.test_bfloat16_cache_accumulates_in_float32(*shape)\n"
    "    pf.test_prefill_matches_dense_attention(*shape)\n"
    "    pf.test_prefill_bfloat16_within_its_rounding(*shape, 'vectors')\n"
    "for dim in (16, 64):\n"
    "    t.test_online_softmax_keeps_extreme_scores_exact(dim)\n"
    "pf.test_prefill_online_softmax_keeps_extreme_scores_exact()\n"
    "pf.test_prefill_chunks_agree_with_the_whole_prompt()\n"
    "pf.test_bfloat16_chunks_agree_with_the_whole_prompt('vectors')\n"
    "from tests.engine import test_norm_rotary_cpu as nr\n"
    "for dtype in (torch.float32, torch.bfloat16):\n"
    "    nr.test_rotation_is_the_op_by_op_rotation_bit_for_bit(dtype, 4, 4, 2, 40)\n"
    "    nr.test_rotation_keeps_special_values_bit_for_bit(dtype)\n"
    "for n in [1, 17, 49157]:\n"
    "    lg.test_matches_aten_on_every_row(torch.ops.preempt_serve.argmax_rows, n)\n"
    "    lg.test_bfloat16_rows_give_their_float32_copy_index(\n"
    "        torch.ops.preempt_serve.argmax_rows, n)\n"
    "from tests.engine import test_layer_ops_cpu as lo\n"
    "for dtype in (torch.float32, torch.bfloat16):\n"
    "    lo.test_silu_mul_is_the_op_by_op_product(dtype, 7, 37)\n"
    "lo.test_add_norm_is_the_sum_then_the_norm(5, 10)\n"
    "lo.test_write_kv_writes_what_index_copy_writes()\n"
    "print('ok')\n"
)


# Each build compiles every operator (about 40 s on two cores): the
# default run checks the AVX2 build, which every AVX2 CPU runs; the
# AVX512 build without bf16 dot products is left to the long run (-m slow).
_LONG_RUN_BUILDS = {"no-bf16-dot"}


@needs_cxx
@pytest.mark.parametrize("build", [
    pytest.param(b, marks=pytest.mark.slow) if b in _LONG_RUN_BUILDS else b
    for b in sorted(_OTHER_BUILDS)])
def test_other_builds_of_this_cpu_match_too(build: str) -> None:
    # A build this CPU can also make, checked in a process of its own (one
    # build of the operators per process).
    import os
    import subprocess
    import sys

    env, differs = _OTHER_BUILDS[build]
    if not differs:
        pytest.skip(f"this process's build is already the {build} one")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _OTHER_BUILD_CHECK],
                          env={**os.environ, **env}, cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_cpu_default_is_cpp_and_cuda_is_refused() -> None:
    assert default_backend_name(torch.device("cpu")) == "cpp"
    with pytest.raises(ValueError, match="CPU only"):
        cpp.CppAttentionBackend(4, 2, 16, 4, torch.device("cuda"))


@needs_cxx
def test_the_operators_run_on_the_engine_threads() -> None:
    if not torch.backends.openmp.is_available():
        pytest.skip("this torch build has no OpenMP")
    cpp.load_kernel()
    # The library is built with OpenMP, so ATen's parallel_for, inlined in
    # its operators (this GEMM's panels, attention's sequences), splits work
    # between the threads torch is given, and keeps to one thread for one.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.ops.preempt_serve.parallel_threads(8) == 1
        torch.set_num_threads(2)
        assert torch.ops.preempt_serve.parallel_threads(8) == 2
    finally:
        torch.set_num_threads(threads)
