"""Capacity study of the RL predictor: the whole backbone, long prompts, more epochs.

The CPU scaling study (`studies/predictor/scaling.py`) could only afford 1-epoch runs
on 3,000 pairs, cut to a few layers.  On a GPU the embedded backbone trains
whole, on every training pair, in minutes, so this study asks the issue's
question at full size: does LoRA on all 30 layers, a prompt of 512 or 1,024
tokens, a higher LoRA rank or more epochs move the figures?

Method (the test split decides nothing):

1. Every variant trains on the training split minus a validation slice of
   15 % taken by prompt (`TrainConfig.val_fraction`), and is scored on that
   slice.  `shipped` is the recipe of the shipped adapter, run the same way.
2. The variant with the lowest validation MAE is the winner.
3. The winner and `shipped` are retrained on the whole training split and
   evaluated once on the test split (`python -m predictor evaluate`).

Every step is resumable: a finished run has its `train_summary.json` (or
`eval_report.json`), an interrupted one its checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predictor.train import read_curve

VAL_FRACTION = 0.15
# Shared by every variant: the shipped adapter's input, head, decoder and rates.
COMMON_ARGS = (
    "--prompt-format", "chat", "--pooling", "mean+last", "--n-heads", "3", "--head-dropout", "0.3",
    "--head", "bins", "--decode", "median", "--lr", "5e-4", "--head-lr", "2e-3",
    "--batch-size", "16", "--checkpoint-every", "100",
)
_SHIPPED = ("--depth", "24", "--lora-layers", "8", "--pool-layers", "16", "24")
# No --depth / --lora-layers: all 30 layers kept, LoRA on every one of them.
_ALL30 = ("--pool-layers", "16", "24", "30")
_P512 = ("--prompt-head", "448", "--prompt-tail", "64")
_P1024 = ("--prompt-head", "896", "--prompt-tail", "128")


@dataclass(frozen=True)
class Variant:
    name: str
    what: str
    args: tuple[str, ...]


VARIANTS: list[Variant] = [
    Variant("shipped", "the shipped recipe: 24 layers, LoRA on the top 8, prompt 96+32, 2.5 epochs",
            (*_SHIPPED, "--epochs", "2.5")),
    Variant("shipped-p512", "the shipped recipe with a 448+64-token prompt",
            (*_SHIPPED, *_P512, "--epochs", "2.5")),
    Variant("all30", "all 30 layers, LoRA on every one, pooled at 16/24/30, 3 epochs",
            (*_ALL30, "--epochs", "3")),
    Variant("all30-e6", "all30, 6 epochs", (*_ALL30, "--epochs", "6")),
    Variant("all30-r32", "all30, LoRA rank 32 (alpha 64)",
            (*_ALL30, "--lora-r", "32", "--lora-alpha", "64", "--epochs", "3")),
    Variant("all30-p512", "all30, prompt 448+64", (*_ALL30, *_P512, "--epochs", "3")),
    Variant("all30-p1024", "all30, prompt 896+128", (*_ALL30, *_P1024, "--epochs", "3")),
    Variant("all30-p512-e6", "all30, prompt 448+64, 6 epochs", (*_ALL30, *_P512, "--epochs", "6")),
]
BY_NAME = {v.name: v for v in VARIANTS}


def _finished(run: Path) -> bool:
    return (run / "train_summary.json").is_file()


def _train_cmd(v: Variant, out: Path, device: str, extra: Sequence[str], final: bool) -> list[str]:
    # Selection runs score the validation slice (every 186 steps, half an
    # epoch); final runs keep the shipped adapter's curve on 600 test pairs.
    split = ("--eval-samples", "600", "--eval-every", "110") if final else (
        "--val-fraction", str(VAL_FRACTION), "--eval-samples", "100000", "--eval-every", "186")
    cmd = [sys.executable, "-m", "predictor", "--device", device, "train",
           *COMMON_ARGS, *v.args, *split, *extra, "--out", str(out)]
    if (out / "checkpoint").is_dir():
        cmd.append("--resume")
    return cmd


def run_parallel(cmds: Sequence[tuple[str, list[str], Path]], parallel: int) -> None:
    """Run `(name, argv, log)` jobs, `parallel` at a time; raise if any fails."""
    pending = list(cmds)
    running: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    failed: list[str] = []
    while pending or running:
        while pending and len(running) < parallel:
            name, argv, log = pending.pop(0)
            log.parent.mkdir(parents=True, exist_ok=True)
            print(" ".join(argv), flush=True)
            with log.open("ab") as f:
                running.append((name, subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT), log))
        time.sleep(1.0)
        for job in list(running):
            name, proc, log = job
            if proc.poll() is not None:
                running.remove(job)
                print(f"{name}: exit {proc.returncode} ({log})", flush=True)
                if proc.returncode:
                    failed.append(name)
    if failed:
        raise RuntimeError(f"runs failed: {failed} (see their logs)")


def select(runs_dir: Path, device: str, parallel: int, extra: Sequence[str] = ()) -> None:
    """Train every selection variant not yet finished."""
    cmds = [
        (v.name, _train_cmd(v, runs_dir / v.name, device, extra, final=False), runs_dir / f"{v.name}.log")
        for v in VARIANTS if not _finished(runs_dir / v.name)
    ]
    run_parallel(cmds, parallel)


def selection_rows(runs_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for v in VARIANTS:
        run = runs_dir / v.name
        if not _finished(run):
            continue
        s = json.loads((run / "train_summary.json").read_text())
        curve = read_curve(run)
        rows.append({"name": v.name, "what": v.what, "args": list(v.args), **s["final"],
                     "n_train": s["n_train"], "n_val": s["n_eval"], "steps": s["steps"],
                     "start_step": s.get("start_step"), "train_seconds": s["train_seconds"],
                     "curve": curve})
    return rows


def winner(rows: Sequence[dict[str, Any]]) -> str:
    """Lowest validation MAE (the first listed wins a tie)."""
    return min(rows, key=lambda r: r["mae"])["name"]


def finalists(rows: Sequence[dict[str, Any]]) -> list[str]:
    best = winner(rows)
    return [best] if best == "shipped" else [best, "shipped"]


def finish(runs_dir: Path, names: Sequence[str], device: str, parallel: int,
           extra: Sequence[str] = ()) -> None:
    """Retrain `names` on the whole training split, then evaluate each on the test split."""
    cmds = [
        (n, _train_cmd(BY_NAME[n], runs_dir / f"final-{n}", device, extra, final=True),
         runs_dir / f"final-{n}.log")
        for n in names if not _finished(runs_dir / f"final-{n}")
    ]
    run_parallel(cmds, parallel)
    evals = [
        (n, [sys.executable, "-m", "predictor", "--device", device, "evaluate",
             "--adapter", str(runs_dir / f"final-{n}"), "--out", str(runs_dir / f"final-{n}"), *extra],
         runs_dir / f"final-{n}.eval.log")
        for n in names if not (runs_dir / f"final-{n}" / "eval_report.json").is_file()
    ]
    run_parallel(evals, parallel)


def final_rows(runs_dir: Path, names: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for n in names:
        run = runs_dir / f"final-{n}"
        if not (run / "eval_report.json").is_file():
            continue
        rep = json.loads((run / "eval_report.json").read_text())
        s = json.loads((run / "train_summary.json").read_text())
        m = rep["model"]
        rows.append({"name": n, "mae": m["mae"], "acc50": m["acc50"], "acc100": m["acc100"],
                     "n_test": m["n"], "steps": s["steps"], "start_step": s.get("start_step"),
                     "train_seconds": s["train_seconds"], "device": s.get("device"),
                     "targets": rep.get("targets"), "baselines": {
                         k: {x: v[x] for x in ("mae", "acc50", "acc100")}
                         for k, v in rep["baselines"].items()}})
    return rows


def _seconds(r: dict[str, Any]) -> str:
    start = r.get("start_step")
    return f"{r['train_seconds']:.0f}" + (f" (steps {start}-{r['steps']})" if start else "")


def render(report: dict[str, Any]) -> str:
    lines = [
        "# RL predictor capacity study (ShareGPT, embedded SmolLM2-135M, GPU)",
        "",
        f"Trained on {report.get('device_name') or report['device']}. Every variant trains on the "
        f"training split less a validation slice of {VAL_FRACTION:.0%} taken by prompt, and is scored on "
        "that slice; the lowest validation MAE wins. The winner and the shipped recipe are then "
        "retrained on the whole training split and evaluated once on the test split.",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        "## Selection (validation slice)",
        "",
        "| variant | what | MAE | Acc-50 | Acc-100 | train s |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["selection"]:
        lines.append(f"| {r['name']} | {r['what']} | {r['mae']:.1f} | {r['acc50']:.1%} | "
                     f"{r['acc100']:.1%} | {_seconds(r)} |")
    if report["selection"]:
        r0 = report["selection"][0]
        lines += ["", f"{r0['n_train']} pairs trained on, {r0['n_val']} scored. "
                      f"Winner: **{report['winner']}**."]
    if report["final"]:
        lines += ["", "## Test split (retrained on the whole training split)", "",
                  "| predictor | MAE | below bucket median | Acc-50 | Acc-100 | train s |",
                  "|---|---|---|---|---|---|"]
        bucket = report["final"][0]["baselines"]["bucket_median"]["mae"]
        for r in report["final"]:
            lines.append(f"| {r['name']} | {r['mae']:.1f} | {1 - r['mae'] / bucket:.1%} | "
                         f"{r['acc50']:.1%} | {r['acc100']:.1%} | {_seconds(r)} |")
        for k, b in report["final"][0]["baselines"].items():
            lines.append(f"| baseline: {k} | {b['mae']:.1f} | {1 - b['mae'] / bucket:.1%} | "
                         f"{b['acc50']:.1%} | {b['acc100']:.1%} | |")
        lines += ["", f"Targets: MAE ≤ {0.8 * bucket:.1f} (20 % below the bucket median), "
                      "Acc-50 ≥ 59 %, Acc-100 ≥ 81 %."]
    lines += ["", "`train s` is the wall time of a run's last uninterrupted segment (a resumed run "
                  "names its steps), with other runs sharing the GPU: it is no speed comparison."]
    return "\n".join(lines) + "\n"
