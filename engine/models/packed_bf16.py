"""bf16 projections on our VDPBF16PS GEMM (`engine/csrc/gemm_bf16.cpp`, CPU).

Where the operators' library has its AVX512-BF16 build, each projection's
weight can be laid out once for that kernel (`pack_in_place`): a 4-D tensor
`[N/16, K/2, 16, 2]` whose every 64-byte line is one vector operand.  On a
Zen 5 core it multiplies SmolLM2's shapes 1.42–1.50× faster than oneDNN's
matmul on its own prepacked weight (`engine.models.prepacked`) at 32 rows,
1.55–2.28× at 8, and 0.97–1.05× as fast at 512 (`studies/engine_cpu/README.md`,
"Projections on VDPBF16PS").  Every output element is summed in one order
fixed by the weight alone, so a row's result never depends on the rows
beside it: deterministic mode needs no row tiles around it.  The packed
weights sit on 2 MiB pages where Linux grants them (`engine.huge_pages`):
a model's projections in one arena (`pack_in_place`), a weight of a huge
page or more (the lm_head) on pages of its own (`pack`).

Where the CPU also has AMX, the library's AMX build multiplies the same
packed weight on the tiles (`engine/csrc/gemm_bf16_amx.h`; weights whose
K is a multiple of 32, chosen by K alone, never by the batch): on a Xeon
with AMX 1.25–1.65× oneDNN's packed matmul at 1–32 rows, 1.02–1.30× at
64, 0.94–1.28× at 128 and 0.82–1.15× at 512
(`studies/engine_cpu/gemm_bf16_amx.json`); the whole bf16 engine there
decodes 1.46–1.49× faster at batch 1, 1.19× at 32, 1.01–1.02× at 96, and
prefills 512 tokens at 0.98–1.06× (`studies/engine_cpu/gemm_amx_ab/`).
`amx(False)` switches a loaded build to its vectors.  On the tiles, a weight
decoded from GGUF codes (the embedded SmolLM2's) can also keep those codes
beside its values (`pack_in_place`'s `codes`, engine.models.weight_codes):
the tiles multiply the codes at a decode step's few rows (1.43-1.51x the
values' rate at 1-32 rows), the values beyond, with the same bits.

`auto` (`CausalLM.pack_projections`) takes it in bfloat16 on a CPU with
`avx512_bf16`, and where the CPU has AMX only on a build with the tiles'
path (the vectors alone run at about a quarter of oneDNN's AMX matmul
there).  With more than one thread the kernel splits the columns between
them by whole panels (the operators' library is built with OpenMP for
that): on two cores 1.37-1.63x oneDNN's matmul at 32 rows
(`studies/engine_cpu/gemm_bf16_2threads.json`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from engine import attention_cpp, huge_pages
from engine.models import weight_codes


def built() -> bool:
    """Whether this process can multiply on the kernel: its library builds
    (or is cached) for this CPU with the AVX512-BF16 path."""
    if not attention_cpp.bf16_dot_wanted():
        return False
    try:
        attention_cpp.load_kernel()
    except RuntimeError:
        return False
    return bool(torch.ops.preempt_serve.bf16_gemm_built())


def preferred(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `auto` takes this kernel: bfloat16 on a CPU with the
    VDPBF16PS build, and where the CPU has AMX, a build that multiplies on
    its tiles (module docstring)."""
    return (device.type == "cpu" and dtype is torch.bfloat16 and built()
            and (not attention_cpp.amx_wanted() or on_tiles()))


def amx(enable: bool = True) -> bool:
    """Switch the loaded kernel's AMX tiles on or off (for studies and tests
    that run both paths of one build); returns whether weights whose K is a
    multiple of 32 are now multiplied on the tiles (False wherever the build
    has no AMX path or the OS refuses the tiles)."""
    attention_cpp.load_kernel()
    return bool(torch.ops.preempt_serve.set_gemm_amx(enable))


def on_tiles() -> bool:
    """Whether the loaded kernel multiplies on AMX tiles now (weights whose
    K is a multiple of 32)."""
    attention_cpp.load_kernel()
    return bool(torch.ops.preempt_serve.gemm_amx())


def packable(w: torch.Tensor) -> bool:
    """A 2-D bfloat16 weight whose shape the layout takes (N in 16s, K even)."""
    return (w.dim() == 2 and w.dtype is torch.bfloat16 and w.device.type == "cpu"
            and w.shape[0] % 16 == 0 and w.shape[1] % 2 == 0)


def pack(w: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """`w` [N, K] in the kernel's layout [N/16, K/2, 16, 2]: in `into` (a 1-D
    bfloat16 tensor of N * K elements: `pack_in_place`'s share of its arena)
    where given, else on 2 MiB pages where it fills at least one
    (engine.huge_pages: a step streams every weight past the TLB)."""
    return huge_pages.place(torch.ops.preempt_serve.pack_bf16(w.detach().contiguous()), into)


def is_packed(w: torch.Tensor) -> bool:
    return w.dim() == 4 and w.shape[2] == 16 and w.shape[3] == 2


def out_features(w: torch.Tensor) -> int:
    """N of a weight, packed or not."""
    return w.shape[0] * 16 if multiplies(w) else w.shape[0]


def multiplies(w: torch.Tensor) -> bool:
    """Whether `w` is packed for this kernel: as `pack` lays it out, or as
    its GGUF codes with those values (`engine.models.weight_codes`)."""
    return is_packed(w) or weight_codes.bf16_codes(w)


def codes_pay() -> bool:
    """Whether a bf16 projection is better kept with its GGUF codes: where
    the loaded kernel multiplies on AMX tiles, which outrun one core's
    stream of bf16 weights at a few rows (engine/csrc/gemm_bf16_codes.cpp).
    Off the tiles the kernel copies the values out before each product."""
    return built() and on_tiles()


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, b)` for 2-D bfloat16 `x` and `w = pack(weight)`
    or `weight`'s codes (`engine.models.weight_codes`)."""
    if w.dtype is torch.uint8:
        return torch.ops.preempt_serve.linear_bf16_codes(x, w, b)
    return torch.ops.preempt_serve.linear_bf16(x, w, b)


def pack_in_place(module: nn.Module, names: tuple[str, ...],
                  codes: Mapping[str, torch.Tensor] | None = None) -> tuple[int, int]:
    """Replace every bfloat16 parameter of `module` whose last name is in
    `names` by its packed form where its shape allows, with its GGUF codes
    (`pack_with_codes`) where `codes` (by parameter name) has them; returns
    (packed, left as they were).  Only a linear that dispatches on the
    layout (`engine.models.prepacked.packed_linear`) can use them afterwards.
    The packed weights share one arena on 2 MiB pages (engine.huge_pages),
    each a slice of it."""
    found = codes or {}
    weights = {id(w): w for _, _, w in projections(module, names) if packable(w)}
    shares = huge_pages.shares({key: w.numel() for key, w in weights.items()}, torch.bfloat16)
    return replace_packable(
        module, names, packable,
        lambda w, name: pack_with_codes(w, found.get(name), into=shares[id(w)]))


def pack_with_codes(w: torch.Tensor, codes: torch.Tensor | None,
                    into: torch.Tensor | None = None) -> torch.Tensor:
    """`pack(w, into)`, with `codes` (`engine.models.weight_codes.fit`'s)
    beside it where they pay (`codes_pay`) and decode to exactly `w`'s
    values (in a buffer of their own: `into` then goes unused)."""
    packed = pack(w, into)
    if codes is not None and codes_pay():
        both = weight_codes.with_values(codes, packed)
        if weight_codes.decodes_to(both, w):
            return both
    return packed


def replace_packable(module: nn.Module, names: tuple[str, ...],
                     can_pack: Callable[[torch.Tensor], bool],
                     packer: Callable[[torch.Tensor, str], torch.Tensor]) -> tuple[int, int]:
    """`pack_in_place` for a kernel given by its `packable` and a packer of
    a weight and its parameter's name (this module's, or
    `engine.models.packed_f32`'s)."""
    packed = left = 0
    for sub, full, w in projections(module, names):
        if can_pack(w):
            setattr(sub, full.rsplit(".", 1)[-1],
                    nn.Parameter(packer(w, full), requires_grad=False))
            packed += 1
        else:
            left += 1
    return packed, left


def projections(module: nn.Module,
                names: tuple[str, ...]) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    """(submodule, full name, weight) of every 2-D parameter of `module`
    whose last name is in `names`."""
    for prefix, sub in module.named_modules():
        for name in names:
            w = getattr(sub, name, None)
            if isinstance(w, nn.Parameter) and w.dim() == 2:
                yield sub, f"{prefix}.{name}" if prefix else name, w
