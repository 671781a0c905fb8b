"""The C++ operators' library (engine/csrc), built for this machine's CPU
and loaded into this process: the paged attention, the projections' GEMMs,
the norms, rotation, SwiGLU, the K/V write, sampling and the one-operator
decoder layers.

`torch.utils.cpp_extension` builds it when the backend is constructed, at the engine's start
(about 30 s the first time, then cached under `TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), with the vector flags of the ATen CPU capability this process
runs with, and the capability in the build's name, so that a cache shared by different CPUs
never serves one a binary built for another, and with OpenMP where torch has it: ATen's
`parallel_for`, inlined into the operators, runs serially without. Where the CPU has
`avx512_bf16`, the build adds that instruction set (and `_bf16` to its name) for the bf16
dot product; PREEMPT_SERVE_CPP_BF16_DOT=0 builds without it. Where it also has AMX
(`amx_tile`, `amx_bf16`), the build adds those (and `_amx`), the bf16 projections' GEMM
multiplies on tiles (`engine/csrc/gemm_bf16_amx.h`), and bf16 decodes go through tiles
(`engine/csrc/paged_decode_amx.h`): keys straight from the cache as tiles, values
interleaved by pairs of keys, the probabilities rounded once to bf16 (their exponential on a
degree-4 polynomial of base 2, which that rounding leaves room for). On an Intel Xeon with
AMX the tiles (then with p in two bf16 terms) were 1.35–1.45× faster than the vectors on K/V
from L3 and 1.74× from L1/L2 (`studies/engine_cpu/decode_op.py`), while whole decode steps
over K/V read from DRAM gained 1.01× there; p in one term made decode steps 1.02–1.06×
faster (`studies/engine_cpu/decode_value_terms.py`). The prefill operator's bf16 scores and
weighted sums go through tiles too (`engine/csrc/paged_prefill_amx.h`, p likewise), and past
64 rows the decoder layer operator takes gate_up's projection and SiLU × up in one pass on
the tiles (`linear_bf16_codes_silu_mul`).
PREEMPT_SERVE_CPP_AMX=0 builds without it; `decode_amx(False)` switches a loaded build's
attention to its vectors. Float32 decodes on an AVX512 build ask for the next sequence's
blocks while the current one is computed on, as bf16 decodes always do, only on an AMD Zen 4
(`decode_lookahead_f32`: there it nearly halves them, on a Zen 5 it made them slower);
PREEMPT_SERVE_F32_LOOKAHEAD=1 or 0 decides instead. A build that fails is retried without
its last additions. Building needs a C++ compiler and ninja; where no build succeeds the
backend says so once and attends with the torch reference.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from engine.cpp_build import (amx_wanted, avx512_half_width, bf16_dot_wanted,
                              build_directory, exclusive_build, put_ninja_on_path,
                              sources_digest)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
# Built into the same library: the prefill operator, the greedy argmax of
# the logits, sampling at a temperature, a Llama layer's bf16 RMSNorm (alone and after its residual
# sum), rotary embedding and SwiGLU product as one operator each, and the
# write of a step's K/V.  Compiled as two translation units that include
# the sources (csrc/unit_decode.cpp says why).
UNITS = [SOURCE.with_name("unit_decode.cpp"), SOURCE.with_name("unit_prefill.cpp")]

# The flags ATen's own kernels of each capability are built with (vec256 /
# vec512); "DEFAULT" gets the compiler's baseline for the architecture.
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq"],
}

_kernel: Callable[..., torch.Tensor] | None = None
_load_error: str | None = None
_capability = ""  # ATen's CPU capability the loaded build was made for


def load_kernel() -> Callable[..., torch.Tensor]:
    """Build (or load the cached build of) the operator; raises where this
    machine cannot build it, the same error on every later call."""
    global _kernel, _load_error, _capability
    if _kernel is not None:
        return _kernel
    if _load_error is not None:
        raise RuntimeError(_load_error)
    lookahead_f32 = _lookahead_f32_wanted()  # a bad value fails here, by name
    try:
        from torch.utils.cpp_extension import load

        put_ninja_on_path()
        capability = torch.backends.cpu.get_cpu_capability()
        flags = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
                 *_ISA_FLAGS.get(capability, [])]
        # OpenMP: on the runtime torch loaded (same soname); see the docstring.
        ldflags = []
        if torch.backends.openmp.is_available():
            flags.append("-fopenmp")
            ldflags.append("-fopenmp")
        # The included files' text in the flags: torch rebuilds where a
        # source or a flag changed, and hashes only the units it is given.
        flags.append(f"-DPREEMPT_SERVE_SOURCES={sources_digest(SOURCE.parent)}")
        name = f"preempt_serve_paged_decode_{capability.lower()}"
        builds = [(name, flags)]
        if capability == "AVX512" and bf16_dot_wanted():
            # A compiler too old for a flag still gets the build without it.
            builds.insert(0, (f"{name}_bf16", [*flags, "-mavx512bf16"]))
            if amx_wanted():
                builds.insert(0, (f"{name}_bf16_amx",
                                  [*flags, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]))
        for i, (build_name, build_flags) in enumerate(builds):
            folder = build_directory(build_name)
            try:
                with exclusive_build(folder):
                    load(name=build_name, sources=[str(p) for p in UNITS],
                         extra_cflags=build_flags, extra_ldflags=ldflags,
                         build_directory=str(folder), is_python_module=False, verbose=False)
                break
            except Exception:
                if i == len(builds) - 1:
                    raise
                log.warning("C++ paged attention: the build %s failed; trying %s",
                            build_name, builds[i + 1][0])
        _kernel = torch.ops.preempt_serve.paged_decode
        _capability = capability
        torch.ops.preempt_serve.set_decode_lookahead_f32(lookahead_f32)
    except Exception as e:  # no compiler, no ninja, or a build error
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _load_error = f"{type(e).__name__}: {first}"
        raise RuntimeError(_load_error) from e
    return _kernel


def loaded() -> bool:
    """Whether this process has loaded the operators (never builds them)."""
    return _kernel is not None


def vectorized() -> bool:
    """Whether the loaded operators are an AVX512 build, whose elementwise
    ones (`silu_mul`) run in vectors; other builds loop element by element,
    slower than ATen's own vectorized ops."""
    return _kernel is not None and _capability == "AVX512"


def silu_mul_vectorized(dtype: torch.dtype) -> bool:
    """Whether `silu_mul` runs in vectors for `dtype`: any dtype on an
    AVX512 build, float32 on an AVX2 one (engine/csrc/silu_mul.cpp)."""
    return vectorized() or (_kernel is not None and _capability == "AVX2"
                            and dtype is torch.float32)


def decode_amx(enable: bool = True) -> bool:
    """Switch the loaded operators' AMX tiles for bf16 attention on or off:
    decodes, and the prefill operator's scores (for studies and tests that
    run both paths of one build); returns whether bf16 decodes now take them
    (False wherever the build has no AMX path or the OS refuses the tiles)."""
    load_kernel()
    return bool(torch.ops.preempt_serve.set_decode_amx(enable))


def _lookahead_f32_wanted() -> bool:
    """PREEMPT_SERVE_F32_LOOKAHEAD: 1 or 0; `auto` (the default) on a Zen 4."""
    wanted = os.environ.get("PREEMPT_SERVE_F32_LOOKAHEAD", "auto")
    if wanted not in ("auto", "0", "1"):
        raise ValueError(f"PREEMPT_SERVE_F32_LOOKAHEAD={wanted!r}: choose auto, 0 or 1")
    return avx512_half_width() if wanted == "auto" else wanted == "1"


def decode_lookahead_f32(enable: bool) -> bool:
    """Switch the float32 decodes' look-ahead to the next sequence's blocks
    on or off (on an AVX512 build; `load_kernel` sets it by CPU: on for a Zen
    4, where it nearly halves float32 decodes on K/V from DRAM,
    studies/engine_cpu/README.md, "float32 decodes' look-ahead on Zen 4");
    returns the setting before (False on other builds, where it does
    nothing)."""
    load_kernel()
    return bool(torch.ops.preempt_serve.set_decode_lookahead_f32(enable))
