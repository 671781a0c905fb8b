"""float32 projections on our AVX2 FMA GEMM (`engine/csrc/gemm_f32.cpp`, CPU).

Where the operators' library builds with AVX2 and FMA, each projection's
weight can be laid out once for that kernel (`pack_in_place`): a 3-D tensor
`[N/16, K, 16]` whose every 64-byte line holds the 16 columns' weights of
one k.  On an AVX2-only Zen 3 core it multiplies SmolLM2's shapes 1.2–1.4×
faster than MKL's sgemm and oneDNN's packed matmul at 32 rows, 1.5–1.8× at
8, and the lm_head 1.2–1.7× (`studies/engine_cpu/README.md`, "float32
projections on AVX2 FMA").  Every output element is one FMA chain over K in
order, so a row's result never depends on the rows beside it:
deterministic mode needs no row tiles around it.

`auto` (`CausalLM.pack_projections`) takes it in float32 on a CPU whose
widest vectors are AVX2's (no `avx512f`), and on one that runs AVX-512 on
256-bit units (AMD Zen 4), where 512-bit vectors do no more arithmetic a
cycle: there, SmolLM2 from its GGUF codes decoded 3.2-3.8x as many tokens
a second at batch 1 as `auto` did before on oneDNN's packed weights,
1.10-1.17x at batch 8, 0.92-1.02x at 32 and 96 (`studies/engine_cpu/README.md`,
"float32 on Zen 4").  On other CPUs with AVX512, oneDNN's
packed matmul runs on 512-bit vectors that this kernel does not use, so
`auto` keeps timing it against `F.linear` there (not measured against this
kernel on such a CPU).  With more than one thread the kernel splits the
columns between them by 16-column panels.

A weight decoded from a GGUF file's Q4_1 or Q8_0 blocks (the embedded
SmolLM2's) is packed as those codes instead (`engine/csrc/gemm_f32_codes.cpp`):
where every block's float16 scale (and minimum) and codes give back every
float32 value exactly, the kernel decodes them into those values as it
multiplies (in registers up to six rows, through a per-thread buffer above)
and sums the same FMA chains as above, so the products are bit for bit the
float32 weight's while a decode step reads about a fifth of the bytes
(SmolLM2: 111 MB instead of 538).  Any other weight stays float32, on 2 MiB
pages where Linux grants them (`engine.huge_pages`; a model's projections in
one arena, `pack_in_place`): on a Zen 4 core SmolLM2's shapes as float32
values ran 1.18-1.73x faster from them at 1 to 32 rows (the whole engine
1.09-1.18x at batch 1 and 8), while codes, a fifth of the bytes, gained
nothing (`studies/engine_cpu/README.md`, "float32 weights on 2 MiB pages").
"""

from __future__ import annotations

import torch
from torch import nn

from engine import attention_cpp, huge_pages
from engine.cpp_build import avx512_half_width, cpu_has
from engine.models import packed_bf16
from engine.models import weight_codes
from engine.models.weight_codes import code_format


def built() -> bool:
    """Whether this process can multiply on the kernel: its library builds
    (or is cached) for this CPU with the AVX2 FMA path."""
    if not (cpu_has("avx2") and cpu_has("fma")):
        return False
    try:
        attention_cpp.load_kernel()
    except RuntimeError:
        return False
    return bool(torch.ops.preempt_serve.f32_gemm_built())


def preferred(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `auto` takes this kernel: float32 on a CPU with AVX2 and FMA
    and either no AVX512F or AVX-512 on 256-bit units (module docstring)."""
    return (device.type == "cpu" and dtype is torch.float32
            and (not cpu_has("avx512f") or avx512_half_width()) and built())


def packable(w: torch.Tensor) -> bool:
    """A 2-D float32 weight whose shape the layout takes (N in 16s)."""
    return (w.dim() == 2 and w.dtype is torch.float32 and w.device.type == "cpu"
            and not w.is_mkldnn and w.shape[0] % 16 == 0)


def pack(w: torch.Tensor, codes: bool = True, into: torch.Tensor | None = None) -> torch.Tensor:
    """`w` [N, K] in the kernel's layout: its codes `[N/16, K/32, bytes]`
    (uint8) where `codes` and it is exactly a Q4_1 or Q8_0 weight, else its
    float32 values `[N/16, K, 16]`, in `into` (a 1-D float32 tensor of N * K
    elements: `pack_in_place`'s share of its arena) where given, else on
    2 MiB pages where they fill at least one."""
    found = _codes(w) if codes else None
    return found if found is not None else _values(w, into)


def _codes(w: torch.Tensor) -> torch.Tensor | None:
    packed = torch.ops.preempt_serve.pack_f32_codes(w.detach().contiguous())
    return packed if packed.numel() else None


def _values(w: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    return huge_pages.place(torch.ops.preempt_serve.pack_f32(w.detach().contiguous()), into)


def is_packed(w: torch.Tensor) -> bool:
    return (w.dim() == 3 and w.shape[2] == 16 and w.dtype is torch.float32
            or weight_codes.f32_codes(w))


def shape(w: torch.Tensor) -> tuple[int, int]:
    """(out, in) features of a packed weight."""
    if code_format(w) is not None:
        return w.shape[0] * 16, w.shape[1] * 32
    return w.shape[0] * 16, w.shape[1]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, b)` for 2-D float32 `x` and `w = pack(weight)`."""
    if w.dtype is torch.uint8:
        return torch.ops.preempt_serve.linear_f32_codes(x, w, b)
    return torch.ops.preempt_serve.linear_f32(x, w, b)


def pack_in_place(module: nn.Module, names: tuple[str, ...],
                  codes: bool = True) -> tuple[int, int]:
    """Replace every float32 parameter of `module` whose last name is in
    `names` by its packed form (as codes where `codes` and `pack` finds
    them) where its shape allows; returns (packed, left as they were).  Only
    `engine.models.prepacked.packed_linear` can use them afterwards.  The
    weights kept as float32 values share one arena on 2 MiB pages
    (engine.huge_pages), each packed straight into its share; the codes are
    found first, since which weights have them is known only then."""
    weights = {id(w): w for _, _, w in packed_bf16.projections(module, names) if packable(w)}
    found = {key: c for key, w in weights.items() if codes and (c := _codes(w)) is not None}
    shares = huge_pages.shares(
        {key: w.numel() for key, w in weights.items() if key not in found}, torch.float32)
    return packed_bf16.replace_packable(
        module, names, packable,
        lambda w, _name: found[id(w)] if id(w) in found else _values(w, shares[id(w)]))
