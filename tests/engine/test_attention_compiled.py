"""The compiled decode kernel: its math, that it really compiles where a C++
compiler exists, and its fall-back where it cannot."""

from __future__ import annotations

import logging
import shutil
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
    md = ref.build_metadata(spans)
    ref.forward(q, k, v, keys, values, md, DIM**-0.5)  # writes this step's K/V
    got = compiled.paged_decode_attention(
        q, keys, values, md.decode_block_tables, md.decode_context_lens, DIM**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_cache_accumulates_in_float32() -> None:
    contexts = [3, 9, 20]
    spans, q, k, v, keys, values = _step(contexts)
    ref = get_attention_backend("torch")(HEADS, KV_HEADS, DIM, BS, torch.device("cpu"))
    md = ref.build_metadata(spans)
    want = ref.forward(q, k, v, keys, values, md, DIM**-0.5)
    got = compiled.paged_decode_attention(
        q.bfloat16(), keys.bfloat16(), values.bfloat16(),
        md.decode_block_tables, md.decode_context_lens, DIM**-0.5)
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


def test_falls_back_when_compiling_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler() -> Any:
        def fail(*args: Any) -> Any:
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return fail

    monkeypatch.setattr(compiled, "_compiled_kernel", no_compiler)
    contexts = [6, 11, 25]
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        got, backend = _forward("compiled", contexts)
    want, _ = _forward("torch", contexts)
    torch.testing.assert_close(got, want)
    assert backend.compiled_ok is False
    assert "InvalidCxxCompiler" in caplog.text
    # Later steps go straight to the reference path.
    spans, q, k, v, keys, values = _step(contexts, seed=1)
    backend.forward(q, k, v, keys, values, backend.build_metadata(spans), DIM**-0.5)
    assert caplog.text.count("unavailable") == 1


def test_defaults() -> None:
    assert default_backend_name(torch.device("cpu")) == "compiled"
    assert default_backend_name(torch.device("cuda")) == "torch"
