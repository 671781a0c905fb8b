"""The command line parses every subcommand; evaluate's default report folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from predictor.__main__ import main
from predictor.config import DatasetConfig
from predictor.dataset import build_pairs, load_tokenizer, write_jsonl

from .conftest import save_member, synthetic_records


@pytest.mark.parametrize(
    "cmd", [[], ["build-dataset"], ["train"], ["evaluate"], ["retrain"], ["bench-latency"]]
)
def test_help(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--help"])
    assert exc.value.code == 0
    assert "usage: python -m predictor" in capsys.readouterr().out


def test_evaluate_writes_under_the_working_directory_not_beside_the_adapter(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = load_tokenizer(str(tiny_llama))
    s = build_pairs(synthetic_records(80), tok, DatasetConfig(tokenizer=str(tiny_llama), n_finetune=60))
    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(pairs, [*s.train, *s.test, *s.serve])
    adapter = save_member(tiny_llama, tmp_path / "adapters" / "mine", 0)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    main(["evaluate", "--adapter", str(adapter), "--pairs", str(pairs), "--no-prefix-cache"])
    assert (work / "runs" / "evaluate" / "mine" / "eval_report.json").is_file()
    assert not (adapter / "eval_report.json").exists()


def test_build_dataset_refuses_pairs_it_would_not_read(tmp_path: Path) -> None:
    # build-dataset writes the splits; a pairs file is for the commands that read them.
    with pytest.raises(SystemExit, match="--pairs"):
        main(["build-dataset", "--pairs", str(tmp_path / "pairs.jsonl")])
