"""Does refining the remaining length during decoding beat the arrival-time
prediction?  (`scheduler/remaining_length.py`, `econoserve.overrun_extension`)

    python -m studies.econoserve_sim.refinement     # -> refinement.json, seconds

The ShareGPT test split with the trained predictor's predictions
(`test_predictions.jsonl`) is cut in two halves by a seeded shuffle: the
refiner learns from the first (as a replica learns from the jobs it
finished) and is scored on the second.  At each point of a job's decoding,
g = f x its prediction p, among the jobs still running there (true length
L > g), three estimates of what is left (L - g) are compared:

- `arrival`: the arrival-time prediction, max(0, p - g), and past it
  EconoServe's extension rule, `overrun_growth` (0.5) x g, at least a block;
- `refined q`: `RemainingLength` at quantile q.

Reported: mean absolute error in tokens, and the share of jobs whose estimate
falls short (each shortfall is another overrun for `econoserve`).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from scheduler.remaining_length import RemainingLength
from studies.econoserve_sim.run import PREDICTIONS, load_pairs

OUT = Path(__file__).resolve().parent
FRACTIONS = [0.25, 0.5, 1.0, 1.15, 1.5, 2.0, 3.0]
QUANTILES = [0.5, 0.8]
GROWTH, BLOCK = 0.5, 16


def arrival_estimate(p: int, g: int) -> int:
    return p - g if g < p else max(BLOCK, math.ceil(GROWTH * g))


def main() -> None:
    pairs = load_pairs(2048)
    random.Random(0).shuffle(pairs)
    fit, score = pairs[: len(pairs) // 2], pairs[len(pairs) // 2:]
    refiners = {q: RemainingLength(quantile=q, window=len(fit)) for q in QUANTILES}
    for r in refiners.values():
        for x in fit:
            r.observe(max(1, x["predicted_len"]), x["response_len"])
    rows: list[dict[str, Any]] = []
    for f in FRACTIONS:
        err: dict[str, list[float]] = {"arrival": [], **{f"refined q{q:g}": [] for q in QUANTILES}}
        short: dict[str, int] = {k: 0 for k in err}
        for x in score:
            p, true_len = max(1, x["predicted_len"]), x["response_len"]
            g = max(1, round(f * p))
            if true_len <= g:
                continue
            left = true_len - g
            ests = {"arrival": arrival_estimate(p, g)}
            for q, r in refiners.items():
                est = r.remaining(p, g)
                ests[f"refined q{q:g}"] = est if est is not None else ests["arrival"]
            for k, e in ests.items():
                err[k].append(abs(e - left))
                short[k] += e < left
        n = len(err["arrival"])
        row = {"fraction": f, "jobs": n}
        for k in err:
            row[k] = {"mae": sum(err[k]) / n, "short_share": short[k] / n}
        rows.append(row)
        print(f"g = {f:g} p ({n} jobs): " + ", ".join(
            f"{k} MAE {row[k]['mae']:.0f} short {100 * row[k]['short_share']:.0f}%"
            for k in err), flush=True)
    (OUT / "refinement.json").write_text(json.dumps(
        {"predictions": PREDICTIONS.name, "fit": len(fit), "scored": len(score),
         "growth": GROWTH, "rows": rows}, indent=1))
    print(f"wrote {OUT / 'refinement.json'}")


if __name__ == "__main__":
    main()
