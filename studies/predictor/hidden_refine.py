"""Would a running job's hidden state sharpen its remaining-length estimate?

    python -m studies.predictor.hidden_refine --n 600 --work /tmp/hidden_refine \
        --out studies/predictor/hidden_refine      # ~15 min on 2 cores

`scheduler/remaining_length.py` refines what is left of a decoding job from
the tokens it has generated (a quantile of what finished jobs that ran as far
past their prediction went on to generate).  The served model's own hidden
state at the job's last position is a richer signal it has for free, and
recent work probes it for the remaining length.  This measures whether it
pays off on the embedded model, before anything is wired into the engine:

1. The engine (SmolLM2-135M-Instruct, `dtype: auto`) answers N ShareGPT
   test-split prompts, framed by the chat template as the server frames a
   chat request, sampled as the live collection samples (temperature 0.7,
   top-p 0.95), up to 1,024 new tokens.  Answers that reach the cap show
   only a lower bound of their length; like `RemainingLength`, they are left
   out (their share is reported).
2. The shipped predictor predicts each prompt's answer length (p).
3. Each answer is run through the model once more (`transformers`,
   float32); the hidden states at the
   position that produced its g-th token, for g in `POINTS`, from the middle
   and the last layer, are the probe's features.
4. Answers are split in halves by a seeded shuffle: estimators learn on one
   and are scored on the other, at every g the answer ran past:
   - `arrival`: p - g, past p EconoServe's extension rule (0.5 g, at least a
     block): what `econoserve` uses without refinement;
   - `refined`: `RemainingLength` (median) fitted on the first half;
   - `ridge, no hidden`: a ridge regression of log(remaining) on log g,
     log prompt length, log p and log(1 + max(0, p - g));
   - `ridge + hidden`: the same features plus both layers' hidden states.
   The ridge penalty is chosen by 5-fold cross-validation over answers of
   the first half.  Reported per g: mean absolute error in tokens and the
   share of estimates that fall short of what is left.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

POINTS = [1, 16, 32, 64, 128, 256, 512]
CAP = 1024
BLOCK, GROWTH = 16, 0.5
LAMBDAS = [10.0 ** k for k in range(-2, 6)]


def _model_and_tokenizer() -> tuple[Any, Any, set[int]]:
    from transformers import AutoModelForCausalLM

    from engine.model_source import resolve_model
    from engine.tokenizer import eos_token_ids, load_tokenizer

    path = resolve_model("embedded:smollm2")
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok, eos_token_ids(path, tok, model.config)


def _prompts(n: int, max_prompt_tokens: int, seed: int) -> list[tuple[str, str]]:
    from predictor.dataset import load_sharegpt_splits

    test = [p for p in load_sharegpt_splits().test if p.prompt_tokens <= max_prompt_tokens]
    random.Random(seed).shuffle(test)
    return [(p.id, p.prompt) for p in test[:n]]


def generate(work: Path, n: int, batch: int, seed: int, max_prompt_tokens: int) -> list[dict]:
    """Answers of the serving model, by the engine itself (`dtype: auto`,
    continuous batching up to `batch` sequences), cached in
    `work/generations.jsonl` (a rerun resumes)."""
    from engine.dtypes import resolve_dtype
    from engine.model_source import resolve_model
    from engine.runner import ModelRunner
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import encode_chat, load_tokenizer
    from scheduler.config import SchedulerConfig
    from scheduler.core import SchedulerCore
    from scheduler.iteration import IterationDriver, OnWallClock
    from scheduler.job import Job

    out_path = work / "generations.jsonl"
    done = {}
    if out_path.is_file():
        for line in out_path.read_text().splitlines():
            rec = json.loads(line)
            done[rec["id"]] = rec
    todo = [(i, p) for i, p in _prompts(n, max_prompt_tokens, seed) if i not in done]
    if todo:
        path = resolve_model("embedded:smollm2")
        tok = load_tokenizer(path)
        max_len = 2048
        runner = ModelRunner(path, resolve_dtype("auto", "cpu"), "cpu", num_blocks=4096, block_size=16,
                             max_model_len=max_len, num_threads=torch.get_num_threads())
        core = SchedulerCore(SchedulerConfig(
            policy="fcfs", block_size=16, num_blocks=4096, max_batch_size=batch,
            max_batch_tokens=2048, max_model_len=max_len), clock=time.monotonic)
        driver = IterationDriver(core, OnWallClock(runner))
        prompts = {i: encode_chat(tok, [{"role": "user", "content": p}]) for i, p in todo}
        outputs: dict[str, list[int]] = {i: [] for i in prompts}
        for k, (i, ids) in enumerate(prompts.items()):
            core.add(Job(i, ids, CAP, arrival_time=0.0))
            runner.add_request(i, SamplingParams(max_tokens=CAP, temperature=0.7, top_p=0.95,
                                                 seed=seed + k), ids)
        t0, finished = time.perf_counter(), 0
        with out_path.open("a") as f:
            while core.has_work:
                for it in driver.steps():
                    for ev in it.events:
                        if ev.token_id is not None:
                            outputs[ev.job_id].append(ev.token_id)
                        if not ev.finished:
                            continue
                        answer = outputs[ev.job_id]
                        stopped = ev.finish_reason == "stop"
                        if stopped and answer and answer[-1] in runner.eos_token_ids:
                            answer = answer[:-1]  # the end-of-turn token itself
                        rec = {"id": ev.job_id, "prompt_ids": prompts[ev.job_id],
                               "output_ids": answer, "censored": not stopped}
                        f.write(json.dumps(rec) + "\n")
                        done[ev.job_id] = rec
                        finished += 1
                        if finished % 50 == 0:
                            f.flush()
                            print(f"generated {finished}/{len(prompts)} "
                                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return [done[i] for i, _ in _prompts(n, max_prompt_tokens, seed) if i in done]


def predict(work: Path, recs: list[dict], prompts: dict[str, str]) -> dict[str, int]:
    """The shipped predictor's prediction for each prompt (cached)."""
    path = work / "predictions.json"
    cached: dict[str, int] = json.loads(path.read_text()) if path.is_file() else {}
    todo = [r for r in recs if r["id"] not in cached]
    if todo:
        from predictor.service import PredictorService

        svc = PredictorService(max_batch_size=32)
        got = svc.predict_lengths([prompts[r["id"]] for r in todo],
                                  [len(r["prompt_ids"]) for r in todo])
        cached.update({r["id"]: int(n) for r, n in zip(todo, got)})
        path.write_text(json.dumps(cached))
    return cached


def hidden_features(work: Path, recs: list[dict]) -> dict[str, dict[int, list[float]]]:
    """Per answer and point g (that it ran past): the middle and last
    layers' hidden states at the position that produced its g-th token."""
    path = work / "hidden.pt"
    if path.is_file():
        return torch.load(path)
    model, _, _ = _model_and_tokenizer()
    n_layers = model.config.num_hidden_layers
    feats: dict[str, dict[int, list[float]]] = {}
    t0 = time.perf_counter()
    for k, r in enumerate(recs):
        length = len(r["output_ids"])
        points = [g for g in POINTS if g < length]
        if not points:
            continue
        ids = torch.tensor([r["prompt_ids"] + r["output_ids"]])
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        base = len(r["prompt_ids"]) - 1  # this position produced output token 1
        feats[r["id"]] = {g: torch.cat([hs[n_layers // 2][0, base + g - 1],
                                        hs[-1][0, base + g - 1]]).tolist() for g in points}
        if k % 100 == 0:
            print(f"hidden states {k}/{len(recs)} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    torch.save(feats, path)
    return feats


def arrival_estimate(p: int, g: int) -> float:
    return p - g if g < p else max(BLOCK, math.ceil(GROWTH * g))


def _base_features(prompt_len: int, p: int, g: int) -> list[float]:
    return [math.log(g), math.log(prompt_len), math.log(max(p, 1)),
            math.log1p(max(0, p - g))]


class Ridge:
    """Closed-form ridge regression on standardised features."""

    def fit(self, x: torch.Tensor, y: torch.Tensor, lam: float) -> Ridge:
        self.mu, self.sd = x.mean(0), x.std(0).clamp_min(1e-6)
        z = (x - self.mu) / self.sd
        self.y0 = y.mean()
        a = z.T @ z + lam * torch.eye(z.shape[1], dtype=z.dtype)
        self.w = torch.linalg.solve(a, z.T @ (y - self.y0))
        return self

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mu) / self.sd) @ self.w + self.y0


def _rows(items: list[dict], with_hidden: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features, log(remaining) and remaining, one row per (answer, g)."""
    xs, left = [], []
    for it in items:
        for g, h in it["hidden"].items():
            x = _base_features(it["prompt_len"], it["p"], g)
            xs.append(x + h if with_hidden else x)
            left.append(it["length"] - g)
    rest = torch.tensor(left, dtype=torch.float64)
    return torch.tensor(xs, dtype=torch.float64), rest.log(), rest


def _choose_lambda(fit: list[dict], with_hidden: bool) -> float:
    """The penalty of least absolute error over 5 folds of answers."""
    folds = [fit[i::5] for i in range(5)]
    errors = {}
    for lam in LAMBDAS:
        err = 0.0
        for i in range(5):
            x, y, _ = _rows([it for j, f in enumerate(folds) if j != i for it in f], with_hidden)
            xv, _, left = _rows(folds[i], with_hidden)
            err += float((Ridge().fit(x, y, lam).predict(xv).exp() - left).abs().sum())
        errors[lam] = err
    return min(errors, key=errors.__getitem__)


def evaluate(items: list[dict], seed: int) -> dict[str, Any]:
    from scheduler.remaining_length import RemainingLength

    random.Random(seed).shuffle(items)
    fit, score = items[: len(items) // 2], items[len(items) // 2:]
    refiner = RemainingLength(quantile=0.5, window=len(fit))
    for it in fit:
        refiner.observe(max(1, it["p"]), it["length"])
    models: dict[str, tuple[Ridge, bool, float]] = {}
    for name, with_hidden in (("ridge, no hidden", False), ("ridge + hidden", True)):
        lam = _choose_lambda(fit, with_hidden)
        x, y, _ = _rows(fit, with_hidden)
        models[name] = (Ridge().fit(x, y, lam), with_hidden, lam)
    rows = []
    for g in POINTS:
        running = [it for it in score if g in it["hidden"]]
        if not running:
            continue
        ests: dict[str, list[float]] = {"arrival": [], "refined": [],
                                        **{m: [] for m in models}}
        left = [it["length"] - g for it in running]
        for it in running:
            p = max(1, it["p"])
            ests["arrival"].append(arrival_estimate(p, g))
            r = refiner.remaining(p, g)
            ests["refined"].append(float(r) if r is not None else arrival_estimate(p, g))
            for name, (model, with_hidden, _) in models.items():
                x = _base_features(it["prompt_len"], it["p"], g)
                if with_hidden:
                    x = x + it["hidden"][g]
                ests[name].append(float(model.predict(
                    torch.tensor([x], dtype=torch.float64)).exp()[0]))
        row: dict[str, Any] = {"g": g, "running": len(running)}
        for name, e in ests.items():
            row[name] = {
                "mae": sum(abs(a - b) for a, b in zip(e, left)) / len(left),
                "short": sum(a < b for a, b in zip(e, left)) / len(left),
            }
        rows.append(row)
    return {"fit_answers": len(fit), "scored_answers": len(score), "rows": rows,
            "lambdas": {m: v[2] for m, v in models.items()}}


def _markdown(report: dict[str, Any]) -> str:
    names = ["arrival", "refined", "ridge, no hidden", "ridge + hidden"]
    lines = ["| g | running | " + " | ".join(f"{n} MAE / short" for n in names) + " |",
             "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for row in report["evaluation"]["rows"]:
        cells = [f"{row[n]['mae']:.0f} / {100 * row[n]['short']:.0f} %" for n in names]
        lines.append(f"| {row['g']} | {row['running']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.predictor.hidden_refine",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hidden_refine"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "hidden_refine")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    recs = generate(a.work, a.n, a.batch, a.seed, a.max_prompt_tokens)
    prompts = dict(_prompts(a.n, a.max_prompt_tokens, a.seed))
    preds = predict(a.work, recs, prompts)
    ended = [r for r in recs if not r["censored"] and r["output_ids"]]
    feats = hidden_features(a.work, ended)
    items = [{"id": r["id"], "prompt_len": len(r["prompt_ids"]), "p": preds[r["id"]],
              "length": len(r["output_ids"]), "hidden": feats.get(r["id"], {})}
             for r in ended]
    lengths = sorted(len(r["output_ids"]) for r in recs)
    report = {
        "command": " ".join(["python -m studies.predictor.hidden_refine", f"--n {a.n}",
                             f"--seed {a.seed}", f"--max-prompt-tokens {a.max_prompt_tokens}"]),
        "answers": len(recs),
        "censored_share": sum(r["censored"] for r in recs) / max(1, len(recs)),
        "answer_len_median": lengths[len(lengths) // 2] if lengths else None,
        "evaluation": evaluate(items, a.seed),
    }
    (a.out / "report.json").write_text(json.dumps(report, indent=1))
    (a.out / "report.md").write_text(_markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()
