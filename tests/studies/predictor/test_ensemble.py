"""make-ensemble: adapters of separate runs gathered into one ensemble folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from predictor.ensemble import PredictorEnsemble, load_any, train_commands
from studies.predictor.__main__ import main

from .conftest import save_member


def test_make_ensemble_copies_members_named_by_seed(tiny_llama: Path, tmp_path: Path) -> None:
    a = save_member(tiny_llama, tmp_path / "runs" / "a" / "adapter", 3)
    b = save_member(tiny_llama, tmp_path / "runs" / "b" / "adapter", 5)
    out = tmp_path / "shipped"
    main(["make-ensemble", "--out", str(out), str(a), str(b)])
    ens = load_any(out)
    assert isinstance(ens, PredictorEnsemble)
    assert sorted(p.name for p in out.iterdir()) == ["ensemble.json", "seed3", "seed5"]
    assert train_commands(out)[:2] == ["train --seed 3", "train --seed 5"]
    assert train_commands(out)[2].startswith("python -m studies.predictor ")
    with pytest.raises(ValueError, match="same seed"):
        main(["make-ensemble", "--out", str(tmp_path / "dup"), str(a), str(a)])
