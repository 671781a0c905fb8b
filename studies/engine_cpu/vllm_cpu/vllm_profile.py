"""Where vLLM-CPU's forward passes spend their time, from the torch
profiler trace its engine wrote (`--profiler-config`, prefill_probe.sh
PROFILE=1): per compiled forward of the model, its time and the time of
the operators inside it, grouped as GEMMs, attention, the K/V write and
Inductor's fused kernels (everything elementwise around them).

    python studies/engine_cpu/vllm_cpu/vllm_profile.py DIR
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

GROUPS = {"_C::onednn_mm": "gemm", "_C::weight_packed_linear": "gemm",
          "_C::cpu_attention_with_kv_cache": "attention",
          "_C::cpu_attn_reshape_and_cache": "kv write",
          "<built-in function kernel>": "inductor kernels"}


def main() -> None:
    trace = next(p for p in Path(sys.argv[1]).glob("rank0*.trace.json.gz"))
    events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]
    forwards = sorted((e for e in events if "torch_aot_compile" in e["name"]),
                      key=lambda e: e["ts"])
    for f in forwards:
        ms: dict[str, float] = defaultdict(float)
        for e in events:
            if e["name"] in GROUPS and e.get("tid") == f.get("tid") \
                    and f["ts"] <= e["ts"] <= f["ts"] + f["dur"]:
                ms[GROUPS[e["name"]]] += e["dur"] / 1e3
        parts = ", ".join(f"{g} {v:.1f}" for g, v in sorted(ms.items(), key=lambda kv: -kv[1]))
        print(f"forward {f['dur'] / 1e3:.1f} ms: {parts}")


if __name__ == "__main__":
    main()
