"""Capacity study: selection on the validation slice, finalists, resumable runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from predictor.config import DatasetConfig
from predictor.dataset import build_pairs, load_tokenizer, write_jsonl
from studies.predictor import capacity
from studies.predictor.__main__ import main

from .conftest import synthetic_records


def _row(name: str, mae: float) -> dict[str, float | str]:
    return {"name": name, "mae": mae}


def test_winner_is_the_lowest_validation_mae_and_shipped_is_always_a_finalist() -> None:
    rows = [_row("shipped", 150.0), _row("all30", 140.0), _row("all30-e6", 140.0)]
    assert capacity.winner(rows) == "all30"  # a tie goes to the first listed
    assert capacity.finalists(rows) == ["all30", "shipped"]
    assert capacity.finalists([_row("shipped", 1.0), _row("all30", 2.0)]) == ["shipped"]


def test_a_failed_run_is_reported_by_name(tmp_path: Path) -> None:
    ok = [sys.executable, "-c", "pass"]
    bad = [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"\['bad'\]"):
        capacity.run_parallel([("ok", ok, tmp_path / "ok.log"), ("bad", bad, tmp_path / "bad.log")], 2)


# Four training runs in subprocesses, each importing torch, transformers and
# peft (half a minute): a study's end-to-end run, left to -m slow.
@pytest.mark.slow
def test_study_selects_retrains_and_tests(tiny_llama: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two variants on a tiny Llama, end to end through the command line."""
    tok = load_tokenizer(str(tiny_llama))
    s = build_pairs(synthetic_records(160), tok, DatasetConfig(tokenizer=str(tiny_llama), n_finetune=120))
    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(pairs, [*s.train, *s.test, *s.serve])
    common = ("--backbone", str(tiny_llama), "--prompt-head", "12", "--prompt-tail", "4",
              "--head", "bins", "--decode", "median", "--batch-size", "8", "--max-steps", "4",
              "--warmup-steps", "0", "--checkpoint-every", "0")
    variants = [capacity.Variant("shipped", "two LoRA layers", ("--lora-layers", "2")),
                capacity.Variant("wide", "LoRA on all layers, rank 16", ("--lora-r", "16"))]
    monkeypatch.setattr(capacity, "COMMON_ARGS", common)
    monkeypatch.setattr(capacity, "VARIANTS", variants)
    monkeypatch.setattr(capacity, "BY_NAME", {v.name: v for v in variants})
    runs, out = tmp_path / "runs", tmp_path / "report"
    argv = ["capacity", "--runs-dir", str(runs), "--pairs", str(pairs), "--parallel", "2", "--out", str(out)]
    main(argv)
    report = json.loads((out / "capacity.json").read_text())
    sel = {r["name"]: r for r in report["selection"]}
    assert set(sel) == {"shipped", "wide"}
    # Selection runs scored the validation slice, not the test split.
    for name, r in sel.items():
        summary = json.loads((runs / name / "train_summary.json").read_text())
        assert summary["eval_on"] == "validation" and r["n_val"] == summary["n_eval"] > 0
        assert r["n_train"] + r["n_val"] == len(s.train)
    assert report["winner"] == min(sel.values(), key=lambda r: r["mae"])["name"]
    finals = {r["name"]: r for r in report["final"]}
    assert set(finals) == {report["winner"], "shipped"}
    for name, r in finals.items():
        evaluated = json.loads((runs / f"final-{name}" / "eval_report.json").read_text())
        assert r["n_test"] == len(s.test) and r["mae"] == evaluated["model"]["mae"]
        assert json.loads((runs / f"final-{name}" / "train_summary.json").read_text())["n_train"] == len(s.train)
    assert "Winner: **" in (out / "capacity.md").read_text()
    # Everything is finished: a second call trains nothing and reports the same.
    before = {p: p.stat().st_mtime_ns for p in runs.glob("*/train_summary.json")}
    main(argv)
    assert before == {p: p.stat().st_mtime_ns for p in runs.glob("*/train_summary.json")}
    assert json.loads((out / "capacity.json").read_text())["final"] == report["final"]
