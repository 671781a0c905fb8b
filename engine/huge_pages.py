"""Host tensors on 2 MiB pages, for weights that every decode step streams.

A decode step reads each projection's weight once; with 4 KiB pages the
core walks a page table for every 4 KiB of it (SmolLM2's packed bf16
projections are 212 MB, about 52,000 pages a step, against a second-level
TLB of a few thousand entries).  On 2 MiB pages the same weights take about
a hundred entries.  On a Zen 4 core SmolLM2's projections from memory ran
1.01-1.03x faster from such pages at 32 rows, 0.97-1.17x at 8 and
1.00-1.16x at one (studies/engine_cpu/README.md, "Weights on 2 MiB
pages"); as float32 values, four times the bytes, 1.18-1.73x at 1 to 32
rows ("float32 weights on 2 MiB pages").

Linux gives an anonymous mapping 2 MiB pages where transparent huge pages
are `always`, or `madvise` and the mapping asks for them (`MADV_HUGEPAGE`),
as here; under `never`, or where the platform has no such advice, the
tensor is an ordinary one and only the speed differs.  `torch`'s own
allocator offers the same through `THP_MEM_ALLOC_ENABLE`, but for every
allocation of 2 MiB or more in the process: a step's temporaries would then
fault in fresh, zeroed 2 MiB pages each time they are allocated.
"""

from __future__ import annotations

import mmap
from collections.abc import Hashable, Mapping
from typing import TypeVar

import torch

K = TypeVar("K", bound=Hashable)

HUGE_PAGE = 2 << 20


def available() -> bool:
    """Whether this platform lets a mapping ask for huge pages."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def setting() -> str:
    """The kernel's transparent huge pages setting, the chosen one in
    brackets (e.g. `always [madvise] never`); "" where it cannot be read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return ""


def on_huge_pages() -> bool:
    """Whether the kernel grants huge pages to a mapping that asks for them:
    the setting is `always` or `madvise`, and this process has not had them
    switched off (`PR_SET_THP_DISABLE`, `THP_enabled: 0` in
    `/proc/self/status`, as some container runtimes do)."""
    chosen = setting()
    if not available() or not chosen or "[never]" in chosen:
        return False
    try:
        with open("/proc/self/status") as f:
            return not any(line.split() == ["THP_enabled:", "0"] for line in f)
    except OSError:
        return False


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements that starts on a
    2 MiB boundary of a mapping advised onto huge pages, where it is at
    least one huge page and the platform has the advice; otherwise
    `torch.empty`.  The mapping lives as long as any view of the tensor."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not available():
        return torch.empty(numel, dtype=dtype)
    # One huge page more than needed, so that a 2 MiB boundary lies within
    # the first; the pages before it are never touched, so never backed.
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    # Before any page is touched, so the first write faults in huge pages.
    region.madvise(mmap.MADV_HUGEPAGE, offset, size - offset)
    return raw[offset:offset + nbytes].view(dtype)


def place(t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """`t`'s values in `into` (a 1-D tensor of as many elements: a share of
    an arena) where given, else on 2 MiB pages of their own where they fill
    at least one (else `t` itself): a packed weight put where a step
    streams it fastest."""
    if into is None:
        if t.numel() * t.element_size() < HUGE_PAGE:
            return t
        into = empty(t.numel(), t.dtype)
    return into.view(t.shape).copy_(t)


def shares(sizes: Mapping[K, int], dtype: torch.dtype) -> dict[K, torch.Tensor]:
    """One arena of `dtype` from `empty`, cut into consecutive 1-D shares of
    `sizes[key]` elements each, by key: a model's packed weights laid out
    together, so that a step streams them through a hundred TLB entries."""
    arena = empty(sum(sizes.values()), dtype)
    out, at = {}, 0
    for key, n in sizes.items():
        out[key] = arena[at:at + n]
        at += n
    return out
