"""Does the batch-invariant GEMM round the same with larger row and column
tiles? (engine/models/matmul_triton.py, on one GPU.)

Deterministic mode multiplies every shape in one tile configuration, so a
2,048-token prefill runs in 64 x 64 tiles that cost 2.1x cuBLAS's time
(`invariant_matmul.py`).  Each output element's sum runs over the same
BLOCK_K slices and the same splits of K whatever BLOCK_M and BLOCK_N are;
whether the tensor-core instructions that a larger tile compiles to also add
each slice's products in the same order is the hardware's and the compiler's
business.  If they do, a large batch could take a larger tile and stay
invariant.  This checks it, bit for bit, on the projections of a
Llama-3-8B layer and its lm_head at 2,048 rows in bfloat16 and float32, with
the split over K the shipped configuration chooses, and times each tile
against the shipped one and cuBLAS (bfloat16, graph-replayed; the layers'
projections only, since a prefill's lm_head multiplies one row).

    python -m studies.engine_gpu.tile_rounding --out studies/engine_gpu/tile_rounding.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.matmul_triton import CONFIG, TileConfig, invariant_linear, splits
from studies.engine_gpu.invariant_matmul import PREFILL, SHAPES
from studies.engine_gpu.kernel_sweep import graph_time

# BLOCK_K stays the shipped one: only the row and column tiles change.
CANDIDATES = [
    TileConfig(128, 64, CONFIG.block_k, 4, 3),
    TileConfig(64, 128, CONFIG.block_k, 4, 3),
    TileConfig(128, 128, CONFIG.block_k, 8, 2),
    TileConfig(128, 128, CONFIG.block_k, 8, 3),
    TileConfig(128, 256, CONFIG.block_k, 8, 2),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(dev), "shipped": list(CONFIG),
                    "rows": PREFILL, "shapes": {}, "ms": {}}
    ms: dict[str, float] = {"cublas": 0.0, "shipped": 0.0}
    for name, n, k, count in SHAPES:
        split = splits(n, k)
        shape: dict = {"n": n, "k": k, "split": list(split), "same": {}}
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(PREFILL, k, device=dev, generator=gen).to(dtype)
            w = (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(dtype)
            shipped = invariant_linear(x, w)
            for cand in CANDIDATES:
                key = "x".join(map(str, cand[:2])) + f"/{cand.warps}w{cand.stages}s"
                try:
                    out = invariant_linear(x, w, config=cand, split=split)
                    same = bool(torch.equal(out, shipped))
                    diff = float((out.float() - shipped.float()).abs().max())
                    verdict = {"same": same, "max_abs_diff": diff}
                    if dtype is torch.bfloat16 and name != "head":
                        t = graph_time(lambda: invariant_linear(x, w, config=cand, split=split))
                        ms[key] = ms.get(key, 0.0) + count * 1e3 * t
                except Exception as e:  # noqa: BLE001 - a tile too large for the device
                    verdict = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                shape["same"].setdefault(key, {})[str(dtype)] = verdict
            if dtype is torch.bfloat16 and name != "head":  # a prefill samples one row
                ms["cublas"] += count * 1e3 * graph_time(lambda: F.linear(x, w))
                ms["shipped"] += count * 1e3 * graph_time(lambda: invariant_linear(x, w))
            del x, w, shipped
        result["shapes"][name] = shape
        print(name, split, {c: {d: v.get("same", v.get("error", "")[:40])
                                for d, v in r.items()} for c, r in shape["same"].items()},
              flush=True)
    result["ms"] = ms
    print("matmul ms of one 2,048-token step (bf16):",
          {key: round(t, 2) for key, t in ms.items()}, flush=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
