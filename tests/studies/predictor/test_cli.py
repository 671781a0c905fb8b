"""The studies' command line parses every subcommand; the product's has none of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from predictor.__main__ import main as product_main
from studies.predictor.__main__ import main

STUDIES = ["probe", "scaling", "capacity", "ceiling", "make-ensemble", "collect-completions"]


@pytest.mark.parametrize("cmd", [[]] + [[c] for c in STUDIES])
def test_help(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--help"])
    assert exc.value.code == 0
    assert "usage: python -m studies.predictor" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", STUDIES)
def test_the_product_cli_does_not_run_studies(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        product_main([cmd, "--help"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_the_product_imports_nothing_from_the_studies() -> None:
    root = Path(__file__).resolve().parents[3]
    for pkg in ("predictor", "workloads"):
        for f in (root / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n == "studies" or n.startswith("studies.") for n in names), f
