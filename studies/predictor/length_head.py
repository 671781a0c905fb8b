"""How well does the engine's length head estimate the served model's answers?

    python -m studies.predictor.length_head --work /tmp/hidden_refine \
        --out studies/predictor/length_head      # ~5 min on 2 cores with cached answers

Reads the engine's own answers to N ShareGPT test prompts that
`studies.predictor.hidden_refine` wrote to `WORK/generations.jsonl` (made
first if missing: ~9 min), with the shipped predictor's predictions of them.
Truth is min(answer length, 1,024), the cap the answers were sampled with:
what an allocation capped by `max_tokens` needs.  Twenty seeded half
splits: each estimator is fitted on one half and scored on the other:

- `predictor`: the shipped predictor's estimate as it is;
- `predictor, calibrated`: log-linear in the predictor's estimate and the
  prompt length, fitted on the half (what serving data could teach it
  without a second training);
- `head`: engine/length_head.py, `fit_from_answers` on the half (ridge
  penalty by 5-fold cross-validation within it).

Then the head is fitted on every answer and written to
`engine/length_heads/smollm2-135m-instruct.pt` (the one `engine_head:
embedded` loads), and the engine itself (`dtype: auto`) computes it for the
first 100 prompts: how far its estimates lie from those on transformers'
float32 states, which the head was fitted on.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine.length_head import EMBEDDED, LengthHead, fit_head
from predictor.fit_head import fit_from_answers, prompt_states

CAP = 1024
PADDING = 0.15
SPLITS = 20


def _metrics(est: torch.Tensor, truth: torch.Tensor, ended: torch.Tensor) -> dict[str, float]:
    e, t = est.double().clamp(1, CAP), truth.double()
    err = (e - t).abs()
    alloc = (e * (1 + PADDING)).ceil()
    return {
        "mae": float(err.mean()),
        "acc50": float((err <= 50).double().mean()),
        "acc100": float((err <= 100).double().mean()),
        "mae_ended": float(err[ended].mean()),
        "under_allocated": float((alloc < t).double().mean()),
        "over_tokens": float((alloc - t).clamp(min=0).mean()),
    }


def evaluate(rows: list[dict[str, Any]], hidden: torch.Tensor,
             preds: list[int]) -> dict[str, Any]:
    n = len(rows)
    plens = torch.tensor([len(r["prompt_ids"]) for r in rows])
    truth = torch.tensor([min(r["length"], CAP) for r in rows])
    ended = torch.tensor([not r["censored"] for r in rows])
    logp = torch.tensor([[math.log(max(1, p))] for p in preds], dtype=torch.float64)
    raw = torch.tensor(preds)
    per: dict[str, list[dict[str, float]]] = {}
    lambdas = []
    for s in range(SPLITS):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(s))
        fit, score = perm[: n // 2], perm[n // 2:]
        head = fit_from_answers([rows[i] for i in fit], hidden[fit], CAP, None, "")
        lambdas.append(head.fit["lambda"])
        calib = fit_head(logp[fit], plens[fit], truth[fit], 0.0, CAP)
        ests = {"predictor": raw[score],
                "predictor, calibrated": calib.predict(logp[score], plens[score]),
                "head": head.predict(hidden[score], plens[score])}
        for name, e in ests.items():
            per.setdefault(name, []).append(_metrics(e, truth[score], ended[score]))
    summary = {name: {k: {"mean": statistics.fmean(m[k] for m in ms),
                          "sd": statistics.pstdev(m[k] for m in ms)} for k in ms[0]}
               for name, ms in per.items()}
    return {"answers": n, "censored": int((~ended).sum()), "splits": SPLITS,
            "lambdas": sorted(set(lambdas)), "estimators": summary}


def engine_drift(rows: list[dict[str, Any]], head_path: Path, hidden: torch.Tensor,
                 n: int) -> dict[str, Any]:
    """The head computed by the engine (dtype auto) against the same head on
    transformers' float32 states, for the first `n` prompts."""
    from engine.dtypes import resolve_dtype
    from engine.model_source import resolve_model
    from engine.runner import ModelRunner
    from engine.sampling_params import SamplingParams
    from scheduler.config import SchedulerConfig
    from scheduler.core import SchedulerCore
    from scheduler.iteration import IterationDriver, OnWallClock
    from scheduler.job import Job

    dtype = resolve_dtype("auto", "cpu")
    runner = ModelRunner(resolve_model("embedded:smollm2"), dtype, "cpu", num_blocks=2048,
                         block_size=16, max_model_len=2048,
                         num_threads=torch.get_num_threads(), length_head=head_path)
    core = SchedulerCore(SchedulerConfig(policy="fcfs", block_size=16, num_blocks=2048,
                                         max_batch_size=32, max_batch_tokens=2048,
                                         max_model_len=2048), clock=time.monotonic)
    jobs = []
    for k, r in enumerate(rows[:n]):
        job = Job(f"j{k}", r["prompt_ids"], 1, arrival_time=0.0)
        jobs.append(job)
        core.add(job)
        runner.add_request(job.job_id, SamplingParams(max_tokens=1), r["prompt_ids"])
    driver = IterationDriver(core, OnWallClock(runner))
    while core.has_work:
        for _ in driver.steps():
            pass
    head = LengthHead.load(head_path)
    plens = torch.tensor([len(r["prompt_ids"]) for r in rows[:n]])
    ref = head.predict(hidden[:n], plens).tolist()
    got = [j.predicted_output_len for j in jobs]
    ratio = sorted(abs(math.log(g / r)) for g, r in zip(got, ref))
    return {"dtype": str(dtype).removeprefix("torch."), "prompts": n,
            "median_abs_log_ratio": ratio[len(ratio) // 2], "max_abs_log_ratio": ratio[-1],
            "mean_abs_tokens": statistics.fmean(abs(g - r) for g, r in zip(got, ref))}


def _relative(path: Path) -> str:
    """`path` from the repository root when it lies inside it."""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def _markdown(rep: dict[str, Any]) -> str:
    ev = rep["evaluation"]
    lines = [
        "# The engine's length head on the embedded model's own answers", "",
        f"`{rep['command']}`", "",
        f"{ev['answers']} answers ({ev['censored']} cut at {CAP} tokens); truth min(length, "
        f"{CAP}); {ev['splits']} half splits, mean (sd) over them; allocation = estimate "
        f"x {1 + PADDING}.", "",
        "| estimator | MAE | Acc-50 | Acc-100 | MAE, answers that ended | under-allocated "
        "| over-allocated tokens |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in ev["estimators"].items():
        cell = {k: (f"{v['mean']:.1f} ({v['sd']:.1f})" if k in ("mae", "mae_ended", "over_tokens")
                    else f"{100 * v['mean']:.1f} % ({100 * v['sd']:.1f})") for k, v in m.items()}
        lines.append(f"| {name} | {cell['mae']} | {cell['acc50']} | {cell['acc100']} | "
                     f"{cell['mae_ended']} | {cell['under_allocated']} | {cell['over_tokens']} |")
    d = rep["engine_drift"]
    lines += ["", f"Engine ({d['dtype']}) against transformers float32 states, first "
              f"{d['prompts']} prompts: median |log ratio| {d['median_abs_log_ratio']:.3f}, "
              f"max {d['max_abs_log_ratio']:.3f}, mean |difference| "
              f"{d['mean_abs_tokens']:.1f} tokens.", ""]
    return "\n".join(lines)


def main() -> None:
    from studies.predictor.hidden_refine import _prompts, generate, predict

    ap = argparse.ArgumentParser(prog="python -m studies.predictor.length_head",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hidden_refine"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "length_head")
    ap.add_argument("--head-out", type=Path, default=EMBEDDED)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    recs = generate(a.work, a.n, 64, a.seed, 512)
    preds = predict(a.work, recs, dict(_prompts(a.n, 512, a.seed)))
    rows = [{"prompt_ids": r["prompt_ids"], "length": len(r["output_ids"]),
             "censored": r["censored"]} for r in recs]
    states = a.work / "prompt_states.pt"
    if states.is_file():
        hidden = torch.load(states)
    else:
        from engine.model_source import resolve_model

        hidden = prompt_states(resolve_model("embedded:smollm2"), [r["prompt_ids"] for r in rows])
        torch.save(hidden, states)
    evaluation = evaluate(rows, hidden, [preds[r["id"]] for r in recs])
    head = fit_from_answers(rows, hidden, CAP, None, "embedded:smollm2 (SmolLM2-135M-Instruct)")
    head.fit["answers"] = "studies/predictor/length_head.py: the engine's sampled answers " \
        f"(temperature 0.7, top-p 0.95) to {len(rows)} ShareGPT test prompts, cap {CAP}"
    head.save(a.head_out)
    report = {
        "command": f"python -m studies.predictor.length_head --n {a.n} --seed {a.seed}",
        "evaluation": evaluation,
        "shipped_head": {"path": _relative(a.head_out), **head.fit},
        "engine_drift": engine_drift(rows, a.head_out, hidden, 100),
    }
    (a.out / "report.json").write_text(json.dumps(report, indent=1))
    (a.out / "report.md").write_text(_markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()
