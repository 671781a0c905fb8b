"""Scaling study of the RL predictor: what moves MAE / Acc-50 / Acc-100.

The issue's targets (Acc-50 ≥ 59 %, Acc-100 ≥ 81 %, MAE 20 % below the
per-bucket median) are those of a Vicuna-7B predictor; when the embedded
135M backbone falls short, the report must say what would reach them,
measured.  Every variant here trains the same way on the same 3,000 training
pairs and is scored on the same first test pairs, changing one axis at a
time against `base`: backbone capacity (decoder layers kept, LoRA layers),
prompt truncation, epochs, and training pairs (up to the 7,000 of the split).  A line through each axis (metric against
log2 of the axis value) says how far that axis alone would have to go.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from predictor.train import read_curve

_BATCH = 16
# Shared by every variant: the shipped adapter's head, decoder and rates.
BASE_ARGS = [
    "--head", "bins", "--decode", "median", "--lr", "5e-4", "--head-lr", "2e-3",
    "--batch-size", str(_BATCH), "--eval-samples", "600",
    "--checkpoint-every", "50",
]


@dataclass(frozen=True)
class Variant:
    name: str
    axis: str  # "base", "depth", "lora_layers", "prompt_tokens", "epochs"
    value: float  # the axis value (for the trend line)
    args: tuple[str, ...]
    # The run this one differs from in one axis (its first trend point).
    ref: str = "base"


def _v(name: str, axis: str, value: float, depth: int = 8, lora: int = 4,
       head: int = 96, tail: int = 32, epochs: float = 1.0, samples: int = 3000,
       seed: int = 0, ref: str = "base") -> Variant:
    # A multi-epoch run also scores itself at the end of every epoch.
    every = -(-samples // _BATCH) if epochs > 1 else 0
    return Variant(name, axis, value, (
        "--depth", str(depth), "--lora-layers", str(lora), "--prompt-head", str(head),
        "--prompt-tail", str(tail), "--epochs", str(epochs), "--eval-every", str(every),
        "--max-train-samples", str(samples), "--seed", str(seed),
    ), ref)


VARIANTS: list[Variant] = [
    _v("base", "base", 8),
    # Run-to-run spread: the base run with another seed (no trend line).
    _v("base-seed1", "seed", 1, seed=1),
    _v("depth16", "depth", 16, depth=16),
    _v("depth30", "depth", 30, depth=30),
    _v("depth30-lora8", "lora_layers", 8, depth=30, lora=8, ref="depth30"),
    _v("prompt32", "prompt_tokens", 32, head=24, tail=8),
    _v("prompt512", "prompt_tokens", 512, head=448, tail=64),
    _v("epochs3", "epochs", 3, epochs=3.0),
    _v("data1000", "train_samples", 1000, samples=1000),
    _v("data7000", "train_samples", 7000, samples=7000),
]
# The reference run's value on each axis (for the trend lines).
BASE_VALUE = {"depth": 8, "lora_layers": 4, "prompt_tokens": 128, "epochs": 1,
              "train_samples": 3000}


def run_variants(runs_dir: Path, names: Sequence[str] | None, threads: int) -> None:
    """Train every variant not yet finished (a run is finished once its
    train_summary.json exists), one process each."""
    for v in VARIANTS:
        if names and v.name not in names:
            continue
        out = runs_dir / v.name
        if (out / "train_summary.json").is_file():
            continue
        cmd = [sys.executable, "-m", "predictor", "--threads", str(threads), "train",
               *BASE_ARGS, *v.args, "--out", str(out)]
        if (out / "checkpoint").is_dir():
            cmd.append("--resume")
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


def fit_log2(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares y = a + b·log2(x); returns (a, b)."""
    lx = [math.log2(x) for x in xs]
    n = len(lx)
    mx, my = sum(lx) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in lx)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def needed(a: float, b: float, target: float, higher_is_better: bool) -> float | None:
    """Axis value at which the line reaches `target` (None: it never does)."""
    if b == 0 or (b > 0) != higher_is_better:
        return None
    return 2 ** ((target - a) / b)


def collect(runs_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for v in VARIANTS:
        run = runs_dir / v.name
        if not (run / "train_summary.json").is_file():
            continue
        curve = read_curve(run)
        summary = json.loads((run / "train_summary.json").read_text())
        rows.append({
            "name": v.name, "axis": v.axis, "value": v.value, "ref": v.ref,
            "args": list(v.args), "final": {k: curve[-1][k] for k in ("mae", "acc50", "acc100")},
            "curve": curve, "train_seconds": summary["train_seconds"],
            "prefix_cache_seconds": summary["prefix_cache_seconds"],
        })
    return rows


def trends(rows: list[dict[str, Any]], targets: dict[str, float]) -> list[dict[str, Any]]:
    """Per axis: the line through base and that axis's variants, and the
    axis value at which it would reach each target."""
    by_name = {r["name"]: r for r in rows}
    out = []
    for axis, base_value in BASE_VALUE.items():
        on_axis = [r for r in rows if r["axis"] == axis]
        ref = by_name.get(on_axis[0].get("ref", "base")) if on_axis else None
        pts = [(base_value, ref["final"])] if ref is not None else []
        pts += [(r["value"], r["final"]) for r in on_axis]
        if axis == "epochs":  # the 3-epoch run's curve gives epochs 1, 2, 3
            run = next((r for r in rows if r["name"] == "epochs3"), None)
            if run is not None:
                pts = [(i + 1, p) for i, p in enumerate(run["curve"][:3])]
        if len(pts) < 2:
            continue
        xs = [p[0] for p in pts]
        entry: dict[str, Any] = {"axis": axis, "points": [[x, p] for x, p in pts], "fits": {}}
        for metric, target in targets.items():
            a, b = fit_log2(xs, [q[metric] for _, q in pts])
            entry["fits"][metric] = {
                "per_doubling": b, "target": target,
                "needed": needed(a, b, target, higher_is_better=metric != "mae"),
            }
        out.append(entry)
    return out


def render(report: dict[str, Any]) -> str:
    b = report["baselines"]
    lines = [
        "# RL predictor scaling study (ShareGPT, embedded SmolLM2-135M)", "",
        f"Same 3,000 training pairs (but on the `train_samples` axis) and first {report['eval_samples']} test pairs for every run, "
        "one axis changed at a time against `base` (8 of 30 decoder layers, LoRA on the top 4, "
        "prompt = first 96 + last 32 tokens, 1 epoch; the LoRA-layers axis against `depth30`). "
        "Trained with:", "",
        "```bash", report["command"], "```", "",
        "| run | axis | value | MAE | Acc-50 | Acc-100 | train s |", "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        f = r["final"]
        lines.append(f"| {r['name']} | {r['axis']} | {r['value']:g} | {f['mae']:.1f} | "
                     f"{f['acc50']:.1%} | {f['acc100']:.1%} | {r['train_seconds'] + r['prefix_cache_seconds']:.0f} |")
    for name, m in b.items():
        lines.append(f"| baseline: {name} | | | {m['mae']:.1f} | {m['acc50']:.1%} | {m['acc100']:.1%} | |")
    lines += ["", "Targets on these test pairs: " + ", ".join(
        f"{k} {'≤' if k == 'mae' else '≥'} {v:.3g}" for k, v in report["targets"].items()), "",
        "Trend per axis (least squares against log2 of the axis value; `needed` = the value at "
        "which the line reaches the target, — where it moves away from it):", "",
        "| axis | points | MAE per doubling | needed | Acc-50 per doubling (points) | needed | Acc-100 per doubling (points) | needed |",
        "|---|---|---|---|---|---|---|---|"]
    for t in report["trends"]:
        cells = []
        for m in ("mae", "acc50", "acc100"):
            f = t["fits"][m]
            scale = 1 if m == "mae" else 100
            n = f["needed"]
            cells += [f"{f['per_doubling'] * scale:+.2f}", "—" if n is None else f"{n:.3g}"]
        pts = ", ".join(f"{x:g}" for x, _ in t["points"])
        lines.append(f"| {t['axis']} | {pts} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
