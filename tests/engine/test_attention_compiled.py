"""The compiled decode kernel: its math, that it really compiles where a C++
compiler exists, and its fall-back where it cannot."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch

import engine.attention_compiled as compiled
from engine.attention import SeqSpan, default_backend_name, get_attention_backend

HEADS, KV_HEADS, DIM, BS, BLOCKS = 6, 2, 16, 4, 48


def _step(
    contexts: list[int], seed: int = 0
) -> tuple[list[SeqSpan], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode-only step over random caches with shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(BLOCKS, generator=gen).tolist()
    spans = [SeqSpan(c - 1, 1, [free.pop() for _ in range(-(-c // BS))]) for c in contexts]
    keys = torch.randn(BLOCKS, BS, KV_HEADS, DIM, generator=gen)
    values = torch.randn(BLOCKS, BS, KV_HEADS, DIM, generator=gen)
    n = len(contexts)
    q = torch.randn(n, HEADS, DIM, generator=gen)
    k = torch.randn(n, KV_HEADS, DIM, generator=gen)
    v = torch.randn(n, KV_HEADS, DIM, generator=gen)
    return spans, q, k, v, keys, values


def _forward(name: str, contexts: list[int]) -> tuple[torch.Tensor, Any]:
    spans, q, k, v, keys, values = _step(contexts)
    backend = get_attention_backend(name)(HEADS, KV_HEADS, DIM, BS, torch.device("cpu"))
    out = backend.forward(q, k, v, keys, values, backend.build_metadata(spans), DIM**-0.5)
    return out, backend


def test_kernel_math_matches_reference_eagerly() -> None:
    # The uncompiled function is the kernel's specification.
    contexts = [1, 5, 16, 17, 30]
    want, ref = _forward("torch", contexts)
    spans, q, k, v, keys, values = _step(contexts)
    ref.forward(q, k, v, keys, values, ref.build_metadata(spans), DIM**-0.5)  # writes K/V
    md = _ragged(spans)
    got = compiled.ragged_decode_attention(
        q, keys, values, md.decode_block_ids, md.decode_block_seq, md.decode_block_len,
        DIM**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _ragged(spans: list[SeqSpan]) -> Any:
    backend = compiled.CompiledAttentionBackend(HEADS, KV_HEADS, DIM, BS, torch.device("cpu"))
    return backend.build_metadata(spans)


def test_ragged_work_list_holds_only_real_blocks() -> None:
    # One row per block a decode holds (no padding to the longest table),
    # the last block of each context partly valid.
    spans, *_ = _step([1, 5, 16, 17])
    md = _ragged(spans)
    assert md.decode_block_seq.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3]
    assert md.decode_block_len.tolist() == [1, 4, 1, 4, 4, 4, 4, 4, 4, 4, 4, 1]
    want_ids = [b for s in spans for b in s.block_table[: -(-s.context_len // BS)]]
    assert md.decode_block_ids.tolist() == want_ids
    # A lone decode has no work list: it takes the reference path.
    assert _ragged(spans[:1]).decode_block_ids is None


def test_one_long_context_does_not_change_the_others() -> None:
    # Rows are independent: a batch with one long outlier gives the short
    # decodes the same output as a batch without it (exact math, no padding
    # leaking into the softmax).
    spans, q, k, v, keys, values = _step([3, 9, 44, 7])
    md = _ragged(spans)
    args = (keys, values, md.decode_block_ids, md.decode_block_seq, md.decode_block_len)
    full = compiled.ragged_decode_attention(q, *args, DIM**-0.5)
    short = [0, 1, 3]
    md2 = _ragged([spans[i] for i in short])
    part = compiled.ragged_decode_attention(
        q[short], keys, values, md2.decode_block_ids, md2.decode_block_seq,
        md2.decode_block_len, DIM**-0.5)
    torch.testing.assert_close(full[short], part, rtol=1e-6, atol=1e-6)


def test_bfloat16_cache_accumulates_in_float32() -> None:
    contexts = [3, 9, 20]
    spans, q, k, v, keys, values = _step(contexts)
    ref = get_attention_backend("torch")(HEADS, KV_HEADS, DIM, BS, torch.device("cpu"))
    want = ref.forward(q, k, v, keys, values, ref.build_metadata(spans), DIM**-0.5)
    md = _ragged(spans)
    got = compiled.ragged_decode_attention(
        q.bfloat16(), keys.bfloat16(), values.bfloat16(),
        md.decode_block_ids, md.decode_block_seq, md.decode_block_len, DIM**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="no C++ compiler")
def test_compiles_where_a_compiler_exists() -> None:
    # Steps of different batch and table widths reuse one compiled graph.
    for contexts in ([7, 30], [2, 3, 4], [40, 1, 12, 33]):
        got, backend = _forward("compiled", contexts)
        want, _ = _forward("torch", contexts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert backend.compiled_ok is True


def _no_compiler() -> Any:
    def fail(*args: Any) -> Any:
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
    return fail


def _miscompiled() -> Any:
    def wrong(q: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.full_like(q, 5e20)
    return wrong


@pytest.mark.parametrize(("kernel", "logged"), [
    (_no_compiler, "InvalidCxxCompiler"),
    (_miscompiled, "disagrees with the reference"),
])
def test_falls_back_where_compiling_fails_or_computes_wrong(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    kernel: Callable[[], Any], logged: str,
) -> None:
    monkeypatch.setattr(compiled, "_compiled_kernel", kernel)
    contexts = [6, 11, 25]
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        got, backend = _forward("compiled", contexts)
    want, _ = _forward("torch", contexts)
    torch.testing.assert_close(got, want)
    assert backend.compiled_ok is False
    assert logged in caplog.text
    # Later steps go straight to the reference path.
    spans, q, k, v, keys, values = _step(contexts, seed=1)
    backend.forward(q, k, v, keys, values, backend.build_metadata(spans), DIM**-0.5)
    assert caplog.text.count("reference attention") == 1


def test_cuda_default_is_triton() -> None:
    assert default_backend_name(torch.device("cuda")) == "triton"
