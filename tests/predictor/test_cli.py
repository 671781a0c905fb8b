"""The command line parses every subcommand."""

from __future__ import annotations

import pytest

from predictor.__main__ import main


@pytest.mark.parametrize(
    "cmd", [[], ["build-dataset"], ["train"], ["evaluate"], ["retrain"], ["bench-latency"]]
)
def test_help(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--help"])
    assert exc.value.code == 0
    assert "usage: python -m predictor" in capsys.readouterr().out
