"""Where one decode step's (or one prefill's) CPU time goes: matmuls, attention, the rest.

Drives our `ModelRunner` through `execute(Plan)` (greedy, `--batch`
sequences sharing a `--context`-token prefix, as `bench/engine_bench.py`
does) under `torch.profiler`, and groups the ops' self CPU time (with
`--prefill`, of one prompt of `--context` tokens prefilled instead):

- matmul: `aten::mm` / `addmm` / `bmm` (the linear layers on plain
  weights), oneDNN's packed linear (the lm_head, and the projections
  where `pack_projections` packs them, `engine/models/prepacked.py`) and
  our bf16 and float32 GEMMs (`engine/models/packed_bf16.py`, `packed_f32.py`,
  on the weights' values or on a GGUF weight's codes; gate_up's with
  SwiGLU's silu(gate) x up fused into its output, `linear_bf16_codes_silu_mul`);
- attention: scaled-dot-product attention kernels, the C++ paged decode
  operator (`engine/attention_cpp.py`, on vectors or on AMX tiles), the
  prefill one, and the Inductor one
  (`engine/attention_compiled.py`: its compiled region, gather fused in);
- kv gather: `aten::index_select` (reading each sequence's paged KV blocks
  into one padded tensor) and `aten::index_copy_` (writing new K/V);
- everything else (norms, rotary, activations, sampling, copies, Python).

    python -m bench.step_profile --out studies/engine_cpu/step_profile.json
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from bench.report import machine_meta, write_report
from bench.engine_bench import OursBench, parse_args as engine_args

_GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise",
               "preempt_serve::linear_bf16", "preempt_serve::linear_bf16_codes",
               "preempt_serve::linear_bf16_codes_silu_mul",
               "preempt_serve::linear_f32", "preempt_serve::linear_f32_codes"),
    "attention": ("preempt_serve::paged_decode", "preempt_serve::paged_decode_tiles",
                  "preempt_serve::paged_prefill",
                  "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_attention_math",
                  "aten::_scaled_dot_product_efficient_attention",
                  "aten::_scaled_dot_product_flash_attention"),
    "kv gather / write": ("aten::index_select", "aten::index_copy_", "preempt_serve::write_kv",
                          "preempt_serve::write_kv_tiles"),
}


def _group(name: str) -> str:
    # Inductor's C++ kernels have no aten name: the profiler charges their
    # time to the compiled region (and its guards / wrapper) that calls them.
    if name.startswith(("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph",
                        "TorchDynamo Cache Lookup")):
        return "attention"
    for g, names in _GROUPS.items():
        if name in names:
            return g
    return "other"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="profiled decode steps (or prefills)")
    ap.add_argument("--prefill", action="store_true",
                    help="profile the prefill of one --context-token prompt, not decode steps")
    ap.add_argument("--attention", default=None, help="torch | compiled | cpp (default: the engine's)")
    ap.add_argument("--pack-projections", default="auto",
                    choices=["auto", "always", "bf16_dot", "f32_fma", "never"],
                    help="projection weights packed for oneDNN (always) or our bf16 / f32 "
                    "kernel (bf16_dot / f32_fma); default: the engine's auto")
    ap.add_argument("--distinct-kv", action="store_true",
                    help="each sequence reads its own copy of the context's K/V (as distinct "
                    "requests do); default: one shared copy")
    ap.add_argument("--top", type=int, default=0, help="also print the N costliest ops")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    ea = engine_args(["--decode-context", str(a.context), "--decode-steps", str(a.steps + 3),
                      "--warmup", "0", "--threads", str(a.threads),
                      "--decode-batches", str(a.batch), "--prefill-lens", str(a.context),
                      "--pack-projections", a.pack_projections,
                      *(["--attention", a.attention] if a.attention else []),
                      *(["--distinct-kv"] if a.distinct_kv else [])])
    ours = OursBench(ea, a.dtype)
    prompt = list(range(100, 100 + a.context))
    if a.prefill:
        def step() -> None:
            ours.prefill(prompt)
    else:
        step = ours.start_decode(prompt, a.batch)
    for _ in range(2):
        step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    wall = (time.perf_counter() - t0) / a.steps
    by_group: dict[str, float] = defaultdict(float)
    total = 0.0
    for ev in prof.key_averages():
        by_group[_group(ev.key)] += ev.self_cpu_time_total
        total += ev.self_cpu_time_total
    for ev in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: a.top]:
        print(f"  {ev.key[:60]:<60} {ev.self_cpu_time_total / 1000 / a.steps:8.2f} ms/step")
    shares = {g: round(v / total, 4) for g, v in sorted(by_group.items(), key=lambda kv: -kv[1])}
    ms = {g: round(v / 1000 / a.steps, 2) for g, v in by_group.items()}
    for g, sh in shares.items():
        print(f"{g:<18} {sh * 100:5.1f} %   {ms[g]:8.2f} ms/step")
    print(f"profiled step (wall, with profiler overhead): {wall * 1000:.1f} ms")
    meta = {"kind": "prefill" if a.prefill else "decode",
            "batch": 1 if a.prefill else a.batch, "context": a.context, "dtype": a.dtype,
            "threads": a.threads,
            "decode_kv": "distinct" if a.distinct_kv else "shared",
            "attention_backend": ours.runner.attn.name,
            "packed_projections": ours.runner.model.packing,
            "packing_speedup": ours.runner.packing_speedup,
            "steps": a.steps, **machine_meta()}
    write_report({"meta": meta, "share": shares, "ms_per_step": ms,
                  "profiled_step_ms": round(wall * 1000, 1)}, a.out)


if __name__ == "__main__":
    main()
