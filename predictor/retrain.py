"""Online retraining on completions our server recorded (EconoServe §3.3.2).

The ShareGPT-trained adapter predicts how long *ChatGPT's* answer was; the
served model answers differently (and stops at its `max_tokens`).  Retraining
continues the adapter on (prompt, produced length) records and is judged on
held-out served completions (prompt-disjoint, by hash): the report shows the
adapter before and after, next to the baselines fitted on the served lengths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from predictor.config import TrainConfig
from predictor.dataset import load_tokenizer, read_served_completions, split_served
from predictor.ensemble import (
    adapter_meta,
    is_ensemble,
    load_any,
    member_dirs,
    read_spec,
    write_ensemble,
)
from predictor.evaluate import evaluate_model
from predictor.model import CONFIG_FILE, read_model_config
from predictor.train import train


def retrain(
    adapter_dir: Path,
    completions: Path,
    out_dir: Path,
    train_cfg: TrainConfig,
    holdout_fraction: float = 0.25,
    progress: bool = True,
) -> dict[str, Any]:
    """Retrain an adapter, or each member of an ensemble (into `out_dir/<member>`)."""
    meta = adapter_meta(adapter_dir)
    length_tok = load_tokenizer(meta.get("length_tokenizer") or meta["model"]["backbone"])
    pairs = read_served_completions(completions, tokenizer=length_tok)
    tr, ho = split_served(pairs, holdout_fraction, seed=train_cfg.seed)
    if not tr or not ho:
        raise ValueError(f"{completions}: too few records to split ({len(pairs)})")
    before = evaluate_model(load_any(adapter_dir).to(train_cfg.device), tr, ho, progress=progress)
    members = read_spec(adapter_dir).members if is_ensemble(adapter_dir) else None
    summaries = []
    for src, rel in zip(member_dirs(adapter_dir), members or ["."]):
        dst = out_dir / rel
        summary = train(read_model_config(src), train_cfg, tr, ho, dst, init_from=src, progress=progress)
        summaries.append({k: v for k, v in summary.items() if k != "losses"})
        # Keep the provenance of the length tokenizer in the new adapter.
        new_meta = json.loads((dst / CONFIG_FILE).read_text())
        new_meta["length_tokenizer"] = meta.get("length_tokenizer")
        new_meta["retrained_from"] = str(src)
        (dst / CONFIG_FILE).write_text(json.dumps(new_meta, indent=2) + "\n")
    if members is not None:
        write_ensemble(out_dir, members)
    after = evaluate_model(load_any(out_dir).to(train_cfg.device), tr, ho, progress=progress)
    keys = ("mae", "acc50", "acc100")
    return {
        "completions": str(completions),
        "n_retrain": len(tr),
        "n_holdout": len(ho),
        "before": before,
        "after": after,
        "delta": {k: after["model"][k] - before["model"][k] for k in keys},
        "improved": after["model"]["mae"] < before["model"]["mae"],
        "train_summary": summaries[0] if len(summaries) == 1 else summaries,
    }


def render_retrain_markdown(report: dict[str, Any]) -> str:
    b, a = report["before"], report["after"]
    lines = [
        "# Online retraining on served completions",
        "",
    ]
    if "command" in report:
        lines += ["Reproduce:", "", "```bash", report["command"], "```", ""]
    lines += [
        f"Records: {report['n_retrain']} for retraining, {report['n_holdout']} held out "
        f"(prompt-disjoint), from `{report['completions']}`.",
        "",
        "| predictor (held-out served completions) | MAE | Acc-50 | Acc-100 | under-provisioned @15% |",
        "| --- | --- | --- | --- | --- |",
    ]

    def row(name: str, m: dict[str, Any]) -> str:
        p15 = next((r for r in m["padding"] if abs(r["ratio"] - 0.15) < 1e-9), m["padding"][0])
        return (
            f"| {name} | {m['mae']:.1f} | {100 * m['acc50']:.1f}% | {100 * m['acc100']:.1f}% | "
            f"{100 * p15['under_share']:.1f}% |"
        )

    lines.append(row("adapter before retraining", b["model"]))
    lines.append(row("adapter after retraining", a["model"]))
    for k, m in a["baselines"].items():
        lines.append(row(f"baseline: {k.replace('_', ' ')} (served lengths)", m))
    d = report["delta"]
    lines += [
        "",
        f"Change: MAE {d['mae']:+.1f} tokens, Acc-50 {100 * d['acc50']:+.1f} points, "
        f"Acc-100 {100 * d['acc100']:+.1f} points: "
        f"{'improved' if report['improved'] else 'NOT improved'} on held-out served completions.",
    ]
    for extra in report.get("notes", []):
        lines += ["", extra]
    return "\n".join(lines) + "\n"
