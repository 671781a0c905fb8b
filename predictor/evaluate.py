"""Evaluation of a trained adapter against the baselines (EconoServe §2.3, Figs. 4-5).

The report holds, for the model (one row per point decoder of the bin head)
and for the two baselines fitted on the training split (the global median and
the median per prompt-length bucket): MAE, Acc-50, Acc-100 and, per padding
ratio 0/10/15/20 %, the share of under-provisioned requests and the over/under
provisioning.  Targets are checked in the report itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from predictor.dataset import Encoded, LengthPair, encode_pairs_for, load_tokenizer
from predictor.metrics import (
    BucketMedianBaseline,
    MedianBaseline,
    Metrics,
    evaluate_predictions,
)
from predictor.ensemble import Predictor, run_on_prefix
from predictor.model import collate, decode, device_of, pad_id_of
from predictor.prefix_cache import PrefixCache

# The targets on the ShareGPT test split.
TARGET_ACC50 = 0.59
TARGET_ACC100 = 0.81
TARGET_MAE_GAIN = 0.20  # MAE at least 20 % below the per-bucket-median baseline


@torch.no_grad()
def head_outputs(
    model: Predictor,
    enc: Encoded,
    pad_id: int,
    cache: PrefixCache | None = None,
    batch_size: int = 32,
    progress: bool = True,
    desc: str = "predict",
) -> torch.Tensor:
    """Raw head outputs for every prompt of `enc`, in input order."""
    was_training = model.training
    model.eval()
    n = len(enc.ids)
    order = sorted(range(n), key=lambda i: len(enc.ids[i]))  # little padding
    outs: list[torch.Tensor | None] = [None] * n
    dev = device_of(model)
    for s in tqdm(range(0, n, batch_size), desc=desc, disable=not progress):
        idx = order[s : s + batch_size]
        ids = [enc.ids[i] for i in idx]
        input_ids, mask = (t.to(dev) for t in collate(ids, pad_id))
        pt = torch.tensor([enc.prompt_tokens[i] for i in idx], device=dev)
        if cache is not None and cache.k > 0:
            out = run_on_prefix(model, cache.k, cache.batch(ids, dev), input_ids, mask, pt)
        else:
            out = model(input_ids, mask, pt)
        out = out.float().cpu()
        for j, i in enumerate(idx):
            outs[i] = out[j]
    model.train(was_training)
    return torch.stack([o for o in outs if o is not None])


def predict_pairs(
    model: Predictor,
    pairs: Sequence[LengthPair],
    tokenizer: Any | None = None,
    cache: PrefixCache | None = None,
    how: str | None = None,
    progress: bool = True,
) -> list[float]:
    tok = tokenizer or load_tokenizer(model.cfg.backbone)
    enc = encode_pairs_for(tok, pairs, model.cfg)
    out = head_outputs(model, enc, pad_id_of(tok), cache, progress=progress)
    return decode(out, model.cfg, how).tolist()


def baseline_metrics(
    train: Sequence[LengthPair], test: Sequence[LengthPair]
) -> dict[str, Metrics]:
    true = [p.response_len for p in test]
    pts = [p.prompt_tokens for p in test]
    med = MedianBaseline([p.response_len for p in train])
    bucket = BucketMedianBaseline(
        [p.prompt_tokens for p in train], [p.response_len for p in train]
    )
    return {
        "train_median": evaluate_predictions(med.predict(pts), true),
        "bucket_median": evaluate_predictions(bucket.predict(pts), true),
    }


def target_check(model: Metrics, bucket: Metrics) -> dict[str, Any]:
    gain = 1.0 - model.mae / bucket.mae if bucket.mae else 0.0
    return {
        "acc50": {"value": model.acc50, "target": TARGET_ACC50, "met": model.acc50 >= TARGET_ACC50},
        "acc100": {"value": model.acc100, "target": TARGET_ACC100, "met": model.acc100 >= TARGET_ACC100},
        "mae_gain_vs_bucket_median": {
            "value": gain,
            "target": TARGET_MAE_GAIN,
            "met": gain >= TARGET_MAE_GAIN,
        },
    }


def evaluate_model(
    model: Predictor,
    train: Sequence[LengthPair],
    test: Sequence[LengthPair],
    cache: PrefixCache | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Metrics of every decoder of `model` and of the baselines on `test`."""
    tok = load_tokenizer(model.cfg.backbone)
    enc = encode_pairs_for(tok, test, model.cfg)
    t0 = time.perf_counter()
    out = head_outputs(model, enc, pad_id_of(tok), cache, progress=progress)
    elapsed = time.perf_counter() - t0
    true = [p.response_len for p in test]
    decoders = ["log"] if model.cfg.head == "log" else ["window", "median", "mean"]
    per_decoder = {
        d: evaluate_predictions(decode(out, model.cfg, None if d == "log" else d).tolist(), true)
        for d in decoders
    }
    chosen = "log" if model.cfg.head == "log" else model.cfg.decode
    base = baseline_metrics(train, test)
    return {
        "n_test": len(test),
        "n_train": len(train),
        "model_config": model.cfg.model_dump(),
        "decoder": chosen,
        "model": per_decoder[chosen].model_dump(),
        "decoders": {d: m.model_dump() for d, m in per_decoder.items()},
        "baselines": {k: m.model_dump() for k, m in base.items()},
        "targets": target_check(per_decoder[chosen], base["bucket_median"]),
        "prefix_cache": cache is not None and cache.k > 0,
        "predict_seconds": elapsed,
        "predict_seconds_per_prompt": elapsed / max(1, len(test)),
    }


# ------------------------------------------------------------------ report


def _row(name: str, m: dict[str, Any]) -> str:
    return f"| {name} | {m['mae']:.1f} | {100 * m['acc50']:.1f}% | {100 * m['acc100']:.1f}% | {m['mean_pred']:.0f} |"


def render_markdown(report: dict[str, Any], title: str = "RL predictor evaluation") -> str:
    lines = [f"# {title}", ""]
    if report.get("train_commands"):
        lines += ["Trained with (in order):", "", "```bash", *report["train_commands"], "```", ""]
    if "command" in report:
        lines += ["Evaluated with:", "", "```bash", report["command"], "```", ""]
    for key in ("where", "train_summary_line"):
        if key in report:
            lines += [str(report[key]), ""]
    lines += [
        f"Test pairs: {report['n_test']}, train pairs: {report['n_train']}. "
        f"Point decoder of the model: `{report['decoder']}`.",
        "",
        "| predictor | MAE (tokens) | Acc-50 | Acc-100 | mean prediction |",
        "| --- | --- | --- | --- | --- |",
    ]
    for d, m in report["decoders"].items():
        lines.append(_row(f"model ({d})", m))
    for k, m in report["baselines"].items():
        lines.append(_row(f"baseline: {k.replace('_', ' ')}", m))
    lines += ["", "Padding (EconoServe §2.3, Figs. 4c and 5a): allocation = ceil(pred × (1 + r)).", ""]
    lines += [
        "| predictor | padding | under-provisioned | covered | mean over (tokens) | over % of alloc | under % of alloc |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = [("model", report["model"])] + [
        (f"{k.replace('_', ' ')}", m) for k, m in report["baselines"].items()
    ]
    for name, m in rows:
        for r in m["padding"]:
            lines.append(
                f"| {name} | {100 * r['ratio']:.0f}% | {100 * r['under_share']:.1f}% | "
                f"{100 * r['covered_share']:.1f}% | {r['mean_over_tokens']:.0f} | "
                f"{r['over_pct_of_alloc']:.1f}% | {r['under_pct_of_alloc']:.1f}% |"
            )
    t = report["targets"]
    lines += [
        "",
        "Targets:",
        "",
        f"- Acc-50 {100 * t['acc50']['value']:.1f}% vs ≥ {100 * t['acc50']['target']:.0f}%: "
        f"{'met' if t['acc50']['met'] else 'NOT met'}",
        f"- Acc-100 {100 * t['acc100']['value']:.1f}% vs ≥ {100 * t['acc100']['target']:.0f}%: "
        f"{'met' if t['acc100']['met'] else 'NOT met'}",
        f"- MAE {100 * t['mae_gain_vs_bucket_median']['value']:.1f}% below the per-bucket median "
        f"vs ≥ {100 * t['mae_gain_vs_bucket_median']['target']:.0f}%: "
        f"{'met' if t['mae_gain_vs_bucket_median']['met'] else 'NOT met'}",
        "",
        f"Evaluation time on this machine: {1000 * report['predict_seconds_per_prompt']:.1f} ms per prompt "
        "(batched, length-sorted"
        + ("; frozen bottom layers read from the prefix cache, so not a serving latency: "
           "see `python -m predictor bench-latency`)." if report.get("prefix_cache") else ")."),
    ]
    for extra in report.get("notes", []):
        lines += ["", extra]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path, stem: str = "eval_report") -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jp = out_dir / f"{stem}.json"
    mp = out_dir / f"{stem}.md"
    jp.write_text(json.dumps(report, indent=2) + "\n")
    mp.write_text(render_markdown(report, report.get("title", "RL predictor evaluation")))
    return jp, mp
