"""Tile configurations of the batch-invariant GEMM (engine/models/matmul_triton.py),
swept on one GPU against cuBLAS (`F.linear`).

Deterministic mode runs every projection through one tile configuration,
whatever the number of rows; this picks the one that costs least over the
shapes a Llama-3-8B step multiplies (bf16): q|k|v, o, gate|up, down per
layer (x 32 layers) and the lm_head for the sampled rows, at decode batches
1 / 32 / 128 and a 2,048-token prefill.  Each launch is replayed 20 times
from a CUDA graph.  Each configuration is also checked for invariance: the
rows of a 2,048-row product equal the same rows multiplied alone or in
slices, bit for bit.  The sweep's second half varies the split over K
(`TileConfig.split_to`) of the chosen tile.  `--large-rows` instead times a
prefill's matmuls with the chosen tile and with `LARGE` (CONFIG's split
kept, as `InvariantLinear` multiplies) from 128 to 2,048 rows: where the
larger tile starts to pay (`LARGE_ROWS`).

    python -m studies.engine_gpu.invariant_matmul --out studies/engine_gpu/invariant_matmul.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.matmul_triton import (
    CONFIG,
    LARGE,
    LARGE_ROWS,
    TileConfig,
    invariant_linear,
    splits,
)
from studies.engine_gpu.kernel_sweep import graph_time

LAYERS = 32
# (name, N, K, per step): the projections of one Llama-3-8B layer, and the head.
SHAPES = [("qkv", 6144, 4096, LAYERS), ("o", 4096, 4096, LAYERS),
          ("gate_up", 28672, 4096, LAYERS),
          ("down", 4096, 14336, LAYERS), ("head", 128256, 4096, 1)]
DECODE = (1, 32, 128)
PREFILL = 2048
CONFIGS = [
    TileConfig(64, 64, 64, 4, 4),
    TileConfig(64, 128, 64, 4, 3),
    TileConfig(128, 64, 64, 4, 3),
    TileConfig(128, 128, 64, 8, 3),
    TileConfig(64, 64, 128, 4, 3, 0),
    TileConfig(32, 64, 128, 4, 4),
    # The chosen tile, split over K until a row tile launches this many programs.
    TileConfig(64, 64, 128, 4, 3, 128),
    TileConfig(64, 64, 128, 4, 3, 256),
    TileConfig(64, 64, 128, 4, 3, 512),
    TileConfig(64, 64, 128, 4, 3, 1024),
    TileConfig(64, 128, 64, 4, 3, 256),
]


def invariant(config: TileConfig, dev: torch.device) -> bool:
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(PREFILL, 4096, device=dev, generator=gen).bfloat16()
    w = (torch.randn(4096, 4096, device=dev, generator=gen) / 64).bfloat16()
    whole = invariant_linear(x, w, config=config)
    return all(torch.equal(invariant_linear(x[a : a + n], w, config=config), whole[a : a + n])
               for a, n in ((0, 1), (777, 1), (5, 31), (100, 64), (1000, 300)))


PREFILL_ROWS = (128, 256, 384, 512, 768, 1024, 1536, 2048)


def step_ms(fn, m: int, dev: torch.device,  # type: ignore[no-untyped-def]
            prefill: bool | None = None) -> float:
    """Matmul time of one step of `m` rows (the head for one row per
    sequence at decode, for one row at prefill; a prefill: `m == PREFILL`
    unless said)."""
    prefill = m == PREFILL if prefill is None else prefill
    total = 0.0
    for name, n, k, count in SHAPES:
        rows = 1 if (name == "head" and prefill) else m
        x = torch.randn(rows, k, device=dev).bfloat16()
        w = (torch.randn(n, k, device=dev) / k**0.5).bfloat16()
        total += count * graph_time(lambda: fn(x, w))
    return 1e3 * total


def _large(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return invariant_linear(x, w, config=LARGE, split=splits(w.shape[0], w.shape[1]))


def large_rows(dev: torch.device) -> dict:
    """A prefill's matmuls at PREFILL_ROWS: cuBLAS, CONFIG, LARGE."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    result: dict = {"device": name, "large_rows": LARGE_ROWS,
                    "config": list(CONFIG), "large": list(LARGE), "rows": []}
    for m in PREFILL_ROWS:
        row = {"rows": m, **{name: step_ms(fn, m, dev, prefill=True) for name, fn in (
            ("cublas_ms", F.linear), ("config_ms", invariant_linear), ("large_ms", _large))}}
        result["rows"].append(row)
        print(m, {k: round(v, 2) for k, v in row.items() if k != "rows"},
              f"large / config {row['large_ms'] / row['config_ms']:.2f}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--splits-only", action="store_true",
                   help="only the chosen tile with and without splits over K")
    p.add_argument("--large-rows", action="store_true",
                   help="only CONFIG against LARGE over a prefill's row counts")
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.large_rows:
        args.out.write_text(json.dumps(large_rows(dev), indent=2))
        return
    ms = (*DECODE, PREFILL)
    result: dict = {"device": torch.cuda.get_device_name(dev), "chosen": list(CONFIG),
                    "rows": list(ms), "cublas_ms": {}, "configs": []}
    for m in ms:
        result["cublas_ms"][m] = step_ms(F.linear, m, dev)
    print("cublas", {m: round(t, 2) for m, t in result["cublas_ms"].items()}, flush=True)
    configs = [c for c in CONFIGS if c[:5] == CONFIG[:5]] if args.splits_only else CONFIGS
    for config in configs:
        row = {"config": list(config), "invariant": invariant(config, dev), "ms": {}}
        for m in ms:
            row["ms"][m] = step_ms(lambda x, w: invariant_linear(x, w, config=config), m, dev)
        result["configs"].append(row)
        ratio = {m: round(row["ms"][m] / result["cublas_ms"][m], 2) for m in ms}
        print(config, "invariant" if row["invariant"] else "NOT INVARIANT",
              {m: round(t, 2) for m, t in row["ms"].items()}, "x cublas", ratio, flush=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
