"""`dtype: auto` by CPU kind, the choice the test suite must not depend on."""

from __future__ import annotations

import pytest

from engine import dtypes


@pytest.mark.parametrize(("native", "expected"), [(True, "bfloat16"), (False, "float32")])
def test_auto_follows_native_bf16_on_cpu(monkeypatch: pytest.MonkeyPatch, native: bool,
                                         expected: str) -> None:
    monkeypatch.setattr(dtypes, "native_bf16_cpu", lambda: native)
    assert dtypes.resolve_dtype("auto", "cpu") == expected
    assert dtypes.resolve_dtype("auto", "cuda") == "bfloat16"
    assert dtypes.resolve_dtype("float32", "cuda") == "float32"


def test_integration_apps_pin_float32() -> None:
    # Their tests compare greedy text across batch compositions; bf16 rounds
    # with the batch, so `auto` would make them pass or fail by CPU kind.
    from tests.integration.conftest import MLFQ_CONFIG, SMALL_CONFIG

    assert SMALL_CONFIG["dtype"] == MLFQ_CONFIG["dtype"] == "float32"


def test_aten_held_below_avx512_counts_as_no_native_bf16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not dtypes.native_bf16_cpu()
    assert dtypes.resolve_dtype("auto", "cpu") == "float32"
