"""Host tensors on 2 MiB pages (engine/huge_pages.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from engine import huge_pages

needs_advice = pytest.mark.skipif(not huge_pages.available(),
                                  reason="this platform has no MADV_HUGEPAGE")


def _mapping_fields(ptr: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping that holds address `ptr`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= ptr < hi
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return fields


def test_less_than_a_huge_page_is_an_ordinary_tensor() -> None:
    t = huge_pages.empty(1000, torch.bfloat16)
    assert t.shape == (1000,) and t.dtype is torch.bfloat16
    t.fill_(2.0)
    assert float(t.float().sum()) == 2000.0


@needs_advice
def test_a_tensor_starts_on_a_huge_page_and_its_views_keep_the_mapping() -> None:
    numel = 3 * huge_pages.HUGE_PAGE // 4 + 12  # bytes: 1.5 huge pages and a bit
    t = huge_pages.empty(numel, torch.float32)
    assert t.shape == (numel,) and t.dtype is torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.copy_(torch.arange(numel, dtype=torch.float32))
    tail = t[-5:]
    ptr = t.data_ptr()
    del t
    gc.collect()
    # The view still reads what was written: the mapping outlived `t`.
    assert tail.tolist() == [float(numel - i) for i in range(5, 0, -1)]
    fields = _mapping_fields(ptr)
    assert fields, "the tensor's mapping is gone while a view of it lives"
    if huge_pages.on_huge_pages() and "THPeligible" in fields:
        # The advice is in place: the kernel may back it with huge pages.
        assert fields["THPeligible"] == "1"


def test_shares_cut_one_arena_in_order() -> None:
    sizes = {"a": 3 * (1 << 18), "b": 5, "c": 1 << 19}  # float32: 3 MiB, 20 B, 2 MiB
    parts = huge_pages.shares(sizes, torch.float32)
    assert list(parts) == list(sizes)
    assert {k: p.numel() for k, p in parts.items()} == sizes
    assert len({p.untyped_storage().data_ptr() for p in parts.values()}) == 1
    assert parts["b"].data_ptr() == parts["a"].data_ptr() + 4 * sizes["a"]
    assert parts["c"].data_ptr() == parts["b"].data_ptr() + 4 * sizes["b"]
    if huge_pages.available():
        assert parts["a"].data_ptr() % huge_pages.HUGE_PAGE == 0
    for i, p in enumerate(parts.values()):
        p.fill_(i)
    assert [int(p.max()) for p in parts.values()] == [0, 1, 2]  # no overlap
    assert huge_pages.shares({}, torch.float32) == {}
