"""Builds every Triton kernel the engine launches for NVIDIA GPUs, without a
GPU: the product's own launch code runs on CPU tensors with each launch
recorded instead of run, and every distinct launch (its argument types and
compile-time constants) is compiled by Triton for Hopper (sm_90) with the
ptxas Triton ships.  The interpreter runs whatever Python a kernel holds;
this catches what only the compiler refuses (a loop-carried value changing
type, an op on a type the GPU lacks) and a tile too large for the shared
memory of one multiprocessor.

    python -m tests.engine.triton_build

Prints one line per kernel built; exits non-zero on the first that does
not build.  Run by tests/engine/test_triton_build.py in a process of its
own: the suite's process has the interpreter switched on."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from engine.attention import SeqSpan
from engine.attention_triton import TritonAttentionBackend
from engine.models.fused_triton import apply_rotary_qk, rms_norm
from engine.models.matmul_triton import LARGE, invariant_linear
from engine.top_k_top_p_triton import top_k_top_p_searched

TARGET = GPUTarget("cuda", 90, 32)
# The shared memory one program may take on Hopper (227 KiB).
SHARED_LIMIT = 232_448
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int32: "i32", torch.int64: "i64", torch.bool: "i1", torch.uint8: "u8"}
# Constants that the launch code sets for the interpreter only (on CPU
# tensors), with the value a GPU launch gives them.
_ON_A_GPU = {"DOT_F32": False}

launches: list[tuple[JITFunction, tuple[Any, ...], dict[str, Any]]] = []


def _record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
    launches.append((self, args, kwargs))


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def build(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip([p.name for p in fn.params], args)) | kwargs
    signature, constants = {}, {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constants[p.name] = _ON_A_GPU.get(p.name, bound[p.name])
        else:
            signature[p.name] = _arg_type(bound[p.name])
    built = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                           target=TARGET, options=options)
    shown = ", ".join(f"{k}={v}" for k, v in constants.items())
    if built.metadata.shared > SHARED_LIMIT:
        raise RuntimeError(f"{fn.__name__}({shown}) needs {built.metadata.shared} bytes of "
                           f"shared memory, more than Hopper's {SHARED_LIMIT}")
    return f"{fn.__name__}({shown}) {built.metadata.shared} B shared"


def _attention(dtype: torch.dtype, deterministic: bool, rows: int = 16,
               heads: int = 9, kv_heads: int = 3, d: int = 64) -> None:
    """A mixed step of SmolLM2's attention layout (9 query heads over 3 KV
    heads of 64) or another: decodes with a long context (split-K) and a
    prefill chunk; `rows`: deterministic mode's query tile."""
    bs, blocks = 16, 64
    backend = TritonAttentionBackend(heads, kv_heads, d, bs, torch.device("cpu"),
                                     deterministic=deterministic, dtype=dtype,
                                     deterministic_rows=rows)
    shapes = [(600, 1), (20, 1), (0, 40)]
    spans, free = [], list(range(blocks))
    for start, n in shapes:
        spans.append(SeqSpan(start, n, [free.pop() for _ in range(-(-(start + n) // bs))]))
    tokens = sum(n for _, n in shapes)
    q = torch.zeros(tokens, heads, d, dtype=dtype)
    kv = torch.zeros(tokens, kv_heads, d, dtype=dtype)
    cache = torch.zeros(blocks, bs, kv_heads, d, dtype=dtype)
    backend.forward(q, kv, kv, cache, cache, backend.build_metadata(spans), d**-0.5)


def scenarios() -> None:
    """The launches a GPU model makes, each in float32 and bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        for deterministic in (False, True):
            _attention(dtype, deterministic)
        # Llama 3 8B's layout, as bench.gpu_step runs it (triton-det64 too).
        for deterministic, rows in ((False, 16), (True, 16), (True, 64)):
            _attention(dtype, deterministic, rows, heads=32, kv_heads=8, d=128)
        x = torch.zeros(5, 576, dtype=dtype)
        rms_norm(x, torch.ones(576, dtype=dtype), 1e-5)
        q, k = torch.zeros(5, 9, 64, dtype=dtype), torch.zeros(5, 3, 64, dtype=dtype)
        table = torch.zeros(64, 64, dtype=torch.float32)
        apply_rotary_qk(q, k, table, table, torch.zeros(5, dtype=torch.long))
        w = torch.zeros(1536, 576, dtype=dtype)
        invariant_linear(x, w)  # K = 576: one split
        # K = 1,536: three splits' partial sums, then their sum with the bias.
        invariant_linear(torch.zeros(5, 1536, dtype=dtype), torch.zeros(576, 1536, dtype=dtype),
                         torch.zeros(576, dtype=dtype))
        if dtype is torch.bfloat16:  # float32's does not fit: InvariantLinear keeps CONFIG
            invariant_linear(x, w, config=LARGE, split=(1, 5))
        top_k_top_p_searched(torch.zeros(2, 49152, dtype=dtype), torch.tensor([50, 49152]),
                             torch.tensor([0.9, 0.5]))


def main() -> int:
    JITFunction.run = _record  # type: ignore[method-assign]
    # The attention backend takes CPU tensors only where it expects the
    # interpreter; its kernels were defined (imported) without it.
    os.environ["TRITON_INTERPRET"] = "1"
    scenarios()
    seen: set[str] = set()
    for fn, args, kwargs in launches:
        key = f"{fn.__name__} {[_arg_type(a) for a in args]} {sorted(kwargs.items())}"
        if key in seen:
            continue
        seen.add(key)
        print(build(fn, args, dict(kwargs)), flush=True)
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: the kernels must be defined for the compiler")
    sys.exit(main())
