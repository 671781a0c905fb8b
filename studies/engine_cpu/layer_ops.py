"""The work around a Llama layer's matmuls on CPU, op by op against the C++
operators that replace it, and gate and up as two GEMMs against one.

For SmolLM2's shapes (hidden 576, MLP 1,536, 3 KV heads of 64) in bfloat16,
one thread, at `--rows` decode rows: SiLU(gate) * up (ATen) against
`silu_mul` over one GEMM's output of both; `x + r` then the norm against
`add_rms_norm_bf16`; two `index_copy_` of a step's K/V into a 65,536-slot
cache against `write_kv`; and the gate and up projections on
oneDNN-packed weights, 30 layers' worth each so that the weights come from
memory as in a step, as two GEMMs against one of both.  Medians of seven
rounds, each timing both sides in turn.  With `--dtype float32`: SiLU × up,
`x + r` then ATen's norm against `add_rms_norm_f32`, and ATen's argmax of
SmolLM2-sized logits against `argmax_rows` (the K/V write and the GEMMs are
bf16's here).

    taskset -c 0 python -m studies.engine_cpu.layer_ops --out studies/engine_cpu/layer_ops.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import engine.attention_cpp as cpp
from bench.report import machine_meta, write_report
from engine.models.prepacked import _ROWS_HINT, packed_linear

HIDDEN, INTER, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 576, 1536, 3, 64, 30, 49152


def _us(fn: Callable[[], object], reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def _pair(a: Callable[[], object], b: Callable[[], object], reps: int,
          rounds: int = 7) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(_us(a, reps))
        tb.append(_us(b, reps))
    return statistics.median(ta), statistics.median(tb)


def measure(rows: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, object]:
    gen = torch.Generator().manual_seed(rows)
    bf = torch.bfloat16
    gate_up = torch.randn(rows, 2 * INTER, generator=gen).to(dtype)
    gate, up = gate_up[:, :INTER].contiguous(), gate_up[:, INTER:].contiguous()
    ops = torch.ops.preempt_serve
    if dtype is not bf:
        x, r = torch.randn(rows, HIDDEN, generator=gen), torch.randn(rows, HIDDEN, generator=gen)
        w = torch.rand(HIDDEN, generator=gen)
        logits = torch.randn(rows, VOCAB, generator=gen)
        res: dict[str, object] = {"rows": rows, "dtype": str(dtype).removeprefix("torch.")}
        for name, a, b, reps in (
            ("silu_mul", lambda: F.silu(gate) * up, lambda: ops.silu_mul(gate_up), 200),
            ("add_norm", lambda: F.rms_norm(x + r, (HIDDEN,), w, 1e-5),
             lambda: ops.add_rms_norm_f32(x, r, w, 1e-5), 300),
            ("argmax", lambda: logits.argmax(dim=-1), lambda: ops.argmax_rows(logits), 20),
        ):
            aten, fused = _pair(a, b, reps)
            res[name] = {"aten_us": round(aten, 1), "operator_us": round(fused, 1)}
        return res
    x = torch.randn(rows, HIDDEN, generator=gen).to(bf)
    r = torch.randn(rows, HIDDEN, generator=gen).to(bf)
    w = torch.rand(HIDDEN, generator=gen).to(bf)
    key_cache = torch.zeros(4096, 16, KV_HEADS, HEAD_DIM, dtype=bf)
    value_cache = torch.zeros_like(key_cache)
    k = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen).to(bf)
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen).to(bf)
    slots = torch.randperm(4096 * 16, generator=gen)[:rows]

    def index_copies() -> None:
        key_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, k)
        value_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, v)

    def pack(out_f: int) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(
            torch.randn(out_f, HIDDEN, generator=gen).to(bf), _ROWS_HINT)

    two = [(pack(INTER), pack(INTER)) for _ in range(LAYERS)]
    one = [pack(2 * INTER) for _ in range(LAYERS)]
    h = torch.randn(rows, HIDDEN, generator=gen).to(bf)

    def gemms_two() -> None:
        for wg, wu in two:
            packed_linear(h, wg)
            packed_linear(h, wu)

    def gemms_one() -> None:
        for wgu in one:
            packed_linear(h, wgu)

    out: dict[str, object] = {"rows": rows}
    for name, a, b, reps in (
        ("silu_mul", lambda: F.silu(gate) * up, lambda: ops.silu_mul(gate_up), 200),
        ("add_norm", lambda: ops.rms_norm_bf16(x + r, w, 1e-5),
         lambda: ops.add_rms_norm_bf16(x, r, w, 1e-5), 300),
        ("kv_write", index_copies, lambda: ops.write_kv(k, v, key_cache, value_cache, slots),
         300),
    ):
        aten, fused = _pair(a, b, reps)
        out[name] = {"aten_us": round(aten, 1), "operator_us": round(fused, 1)}
    sep, merged = _pair(gemms_two, gemms_one, 5)
    out["gate_up_gemm_per_layer"] = {"two_us": round(sep / LAYERS, 1),
                                     "one_us": round(merged / LAYERS, 1)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.engine_cpu.layer_ops",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="8,32,96")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cpp.load_kernel()
    results = []
    for rows in (int(n) for n in a.rows.split(",")):
        res = measure(rows, getattr(torch, a.dtype))
        print(res, flush=True)
        results.append(res)
    if a.out is not None:
        write_report({"meta": machine_meta(), "results": results}, a.out)


if __name__ == "__main__":
    main()
