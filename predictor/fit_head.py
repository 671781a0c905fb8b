"""Fit the engine's length head (engine/length_head.py) on a model's answers.

    python -m predictor fit-head --answers FILE.jsonl --out head.pt \
        [--model embedded:smollm2] [--cap 1024] [--lambda L]

Each line of FILE is one answer the served model gave: `prompt_ids` (the
prompt as the engine computed it, chat template included), the answer's
length (`output_len`, or `output_ids`) and whether `max_tokens` cut it
(`censored`).  The server's own log of what it served
(`predictor.record_dir`, deployments/served_log.py) is such a file per
Ingress replica: pass its folder.  `python -m studies.predictor.hidden_refine`
writes one from the engine's answers to ShareGPT prompts.  The features are the model's final
hidden state (after the last norm) at each prompt's last position, computed
in float32 by `transformers`; the engine's forward pass gives the same rows
(tests/engine/test_length_head.py).  Without `--lambda`, the ridge penalty
is the one of least absolute error over 5 folds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from engine.length_head import LengthHead, fit_head

LAMBDAS = (100.0, 300.0, 1000.0, 3000.0, 10000.0)


def read_answers(path: str | Path, cap: int) -> tuple[list[dict[str, Any]], int]:
    """The answers in a JSONL file, or in every `served-*.jsonl` of a folder
    (the server's log, `predictor.record_dir`), and how many lines were left
    out: lines without `prompt_ids` (logs written before they were
    recorded), and answers cut by `max_tokens` short of `cap`, whose
    min(length, cap) is unknown."""
    p = Path(path)
    files = sorted(p.glob("served-*.jsonl")) if p.is_dir() else [p]
    rows, left_out = [], 0
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            r = json.loads(line)
            length = r.get("output_len", len(r.get("output_ids", [])))
            if not isinstance(length, int):
                raise ValueError(f"{f}:{n}: needs output_len (or output_ids)")
            censored = bool(r.get("censored", False))
            if not r.get("prompt_ids") or (censored and length < cap):
                left_out += 1
                continue
            rows.append({"prompt_ids": list(r["prompt_ids"]), "length": length,
                         "censored": censored})
    return rows, left_out


def prompt_states(model_path: str | Path, prompts: list[list[int]],
                  log_every: int = 100) -> torch.Tensor:
    """`[N, H]` float32: each prompt's final hidden state at its last position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, local_files_only=True).eval()
    out = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for k, ids in enumerate(prompts):
            hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            out.append(hs[-1][0, -1].float())
            if log_every and (k + 1) % log_every == 0:
                print(f"prompt states {k + 1}/{len(prompts)} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return torch.stack(out)


def choose_lambda(hidden: torch.Tensor, plens: torch.Tensor, lengths: torch.Tensor,
                  cap: int, folds: int = 5) -> float:
    """The penalty whose fits err least (absolute, on min(length, cap))
    on the held-out fold, over `folds` folds."""
    n = hidden.shape[0]
    err = {}
    for lam in LAMBDAS:
        total = 0.0
        for f in range(folds):
            held = torch.arange(n) % folds == f
            head = fit_head(hidden[~held], plens[~held], lengths[~held], lam, cap)
            est = head.predict(hidden[held], plens[held])
            total += float((est - lengths[held].clamp(max=cap)).abs().sum())
        err[lam] = total
    return min(err, key=err.__getitem__)


def fit_from_answers(rows: list[dict[str, Any]], hidden: torch.Tensor, cap: int,
                     lam: float | None, model: str) -> LengthHead:
    plens = torch.tensor([len(r["prompt_ids"]) for r in rows])
    # The head estimates min(length, cap): an answer cut at or past the cap
    # counts as the cap (`read_answers` leaves out those cut short of it).
    lengths = torch.tensor([min(r["length"], cap) for r in rows])
    if lam is None:
        lam = choose_lambda(hidden, plens, lengths, cap)
    return fit_head(hidden, plens, lengths, lam, cap, model=model)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fit-head", help="fit the engine's length head on a model's answers")
    p.add_argument("--answers", required=True,
                   help="a JSONL file (prompt_ids, output_len, censored) or a folder of the "
                        "server's served-*.jsonl logs (predictor.record_dir)")
    p.add_argument("--out", required=True, help="the head file (for predictor.engine_head)")
    p.add_argument("--model", default="embedded:smollm2", help="the served model")
    p.add_argument("--cap", type=int, default=1024,
                   help="the answers' max_tokens: the head estimates min(length, cap)")
    p.add_argument("--lambda", dest="lam", type=float, default=None,
                   help="ridge penalty; default: chosen by 5-fold cross-validation")
    p.set_defaults(func=cmd_fit_head)


def cmd_fit_head(a: argparse.Namespace) -> None:
    from engine.model_source import resolve_model

    rows, left_out = read_answers(a.answers, a.cap)
    if len(rows) < 20:
        raise SystemExit(f"{a.answers}: {len(rows)} usable answers ({left_out} left out); "
                         "a head needs many more")
    hidden = prompt_states(resolve_model(a.model), [r["prompt_ids"] for r in rows])
    head = fit_from_answers(rows, hidden, a.cap, a.lam, a.model)
    head.fit["left_out"] = left_out
    head.save(a.out)
    print(json.dumps({"out": a.out, **head.fit}, indent=2))
