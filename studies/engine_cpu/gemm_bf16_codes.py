"""bf16 projections from their GGUF codes against the packed bf16 weights,
one CPU thread (engine/csrc/gemm_bf16_codes.cpp against gemm_bf16_amx.h).

SmolLM2's four projection shapes (qkv 960 x 576, o 576 x 576, gate_up
3,072 x 576, down 576 x 1,536), 30 layers of distinct Q4_1-shaped weights
(every 32 values of a row m + d q, as the embedded GGUF decodes), all 120
multiplied in turn as in one decode step, so that every weight comes from
memory; and its lm_head (49,152 x 576, Q8_0-shaped: d q), two copies used
in turn.  At each row count, rounds alternate the two ways; medians of the
whole pass; whether the products are the same bits (they must be).

    taskset -c 0 python -m studies.engine_cpu.gemm_bf16_codes \\
        --out studies/engine_cpu/gemm_bf16_codes.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.report import machine_meta, write_report
from engine.models import packed_bf16, weight_codes

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head (two copies)": (49152, 576)}


def q4_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 weight every 32 values of whose rows are m + d q, d and m
    float16, q in 0..15 with 0 and 15 in every block."""
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half().float()
    m = (torch.rand(n, k // 32, 1, generator=gen) - 0.5).mul(0.2).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    q[:, :, 0], q[:, :, 1] = 0, 15
    return (d * q + m).reshape(n, k)


def q8_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 weight every 32 values of whose rows are d q, d float16,
    q in -127..127 with -127 in every block."""
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen)
    q[:, :, 5] = -127
    return (d * q).reshape(n, k)


def _pass(xs: dict[int, torch.Tensor], plain: list[torch.Tensor],
          ws: list[torch.Tensor]) -> float:
    t = time.perf_counter()
    for p, w in zip(plain, ws):
        packed_bf16.linear(xs[p.shape[1] * 2], w)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64,65,96,256,512")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not (packed_bf16.built() and packed_bf16.codes_pay()):
        raise SystemExit("needs the operators' AMX build (bf16 codes pay only on the tiles)")
    gen = torch.Generator().manual_seed(0)
    plain: list[torch.Tensor] = []
    codes: list[torch.Tensor] = []
    for _ in range(a.layers):
        for n, k in list(SHAPES.values())[:4]:
            w = q4_weight(n, k, gen)
            fitted = weight_codes.fit(w)
            assert fitted is not None
            plain.append(packed_bf16.pack(w.bfloat16()))
            codes.append(weight_codes.with_values(fitted, plain[-1]))
    heads: dict[str, list[torch.Tensor]] = {"bf16": [], "codes": []}
    for _ in range(2):
        w = q8_weight(49152, 576, gen)
        fitted = weight_codes.fit(w)
        assert fitted is not None
        heads["bf16"].append(packed_bf16.pack(w.bfloat16()))
        heads["codes"].append(weight_codes.with_values(fitted, heads["bf16"][-1]))
    rows_out = []
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}
        same = all(torch.equal(packed_bf16.linear(xs[p.shape[1] * 2], p),
                               packed_bf16.linear(xs[p.shape[1] * 2], c))
                   for p, c in zip(plain[:4], codes[:4]))
        same = same and torch.equal(packed_bf16.linear(xs[576], heads["bf16"][0]),
                                    packed_bf16.linear(xs[576], heads["codes"][0]))
        times: dict[str, list[float]] = {"bf16": [], "codes": [], "head_bf16": [],
                                         "head_codes": []}
        for _ in range(1 + a.rounds):
            for name, ws in (("bf16", plain), ("codes", codes)):
                times[name].append(_pass(xs, plain, ws))
            for name in ("bf16", "codes"):
                times[f"head_{name}"].append(_pass(xs, heads["bf16"], heads[name]) / 2)
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
        rows_out.append({"rows": m, "ms": med, "codes_speedup": med["bf16"] / med["codes"],
                         "head_codes_speedup": med["head_bf16"] / med["head_codes"],
                         "same_bits": same})
        print(rows_out[-1])
    mb = {"bf16": sum(p.numel() * 2 for p in plain) / 1e6,
          "codes": sum(c.numel() - p.numel() * 2 for p, c in zip(plain, codes)) / 1e6,
          "head_bf16": heads["bf16"][0].numel() * 2 / 1e6,
          "head_codes": (heads["codes"][0].numel() - heads["bf16"][0].numel() * 2) / 1e6}
    report = {"meta": {**machine_meta(), "layers": a.layers, "rounds": a.rounds,
                       "statistic": "median of the rounds", "weights_mb": mb,
                       "shapes": SHAPES},
              "results": rows_out}
    write_report(report, a.out)


if __name__ == "__main__":
    main()
