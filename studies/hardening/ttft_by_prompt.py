"""Admitted TTFT of an overload run by prompt length.

    python -m studies.hardening.ttft_by_prompt RUN.json [RUN.json ...] [--slo 2.0]

Reads `python -m bench overload --save-records` results.  Under admission
control a request whose own prefill takes longer than the TTFT objective is
admitted only with nothing ahead of it (scheduler/admission.py), so its
TTFT is its prefill; this splits the admitted requests by prompt length to
show which part of the tail is queueing and which is the prompt itself,
and which prompts the refusals fall on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

BUCKETS = ((0, 128), (128, 256), (256, 512), (512, 1024), (1024, 4096))


def ttfts(path: Path) -> tuple[list[tuple[int, float]], list[int]]:
    """(prompt tokens, TTFT) of each admitted request that got a token, and
    the prompt lengths of the refused ones."""
    data = json.loads(path.read_text())
    out, refused = [], []
    for r in data.get("records") or []:
        if r["rejected"]:
            refused.append(int(r["prompt_tokens"]))
        elif r["token_times"]:
            out.append((int(r["prompt_tokens"]), r["token_times"][0] - r["send_time"]))
    return out, refused


def summary(rows: list[tuple[int, float]], refused: list[int],
            slo: float) -> list[dict[str, object]]:
    table = []
    for lo, hi in BUCKETS:
        t = np.array([x for p, x in rows if lo <= p < hi])
        n_refused = sum(lo <= p < hi for p in refused)
        if not len(t) and not n_refused:
            continue
        line: dict[str, object] = {"prompt": f"{lo}-{hi - 1}", "refused": n_refused,
                                   "admitted": int(len(t))}
        if len(t):
            line.update(p50_s=round(float(np.percentile(t, 50)), 2),
                        p99_s=round(float(np.percentile(t, 99)), 2),
                        max_s=round(float(t.max()), 2), over_slo=int((t > slo).sum()))
        table.append(line)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--slo", type=float, default=2.0)
    a = ap.parse_args()
    for path in a.runs:
        rows, refused = ttfts(path)
        print(f"{path}: {len(refused)} refused, {len(rows)} admitted, "
              f"{sum(x > a.slo for _, x in rows)} over {a.slo:g} s")
        for line in summary(rows, refused, a.slo):
            print("  " + "  ".join(f"{k} {v}" for k, v in line.items()))


if __name__ == "__main__":
    main()
