"""The GPU-trained adapter kept with its study still serves what its evaluation scored."""

from __future__ import annotations

from pathlib import Path

from tests.predictor.test_service import check_serves_what_evaluation_scored

STUDY = Path(__file__).resolve().parents[3] / "studies" / "predictor"


def test_long_adapter_serves_what_evaluation_scored() -> None:
    check_serves_what_evaluation_scored(STUDY / "smollm2-sharegpt-long")
