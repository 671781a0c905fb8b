"""Seed ensembles: copy adapters trained with other seeds into one ensemble folder.

The ensemble format and its loader are the product's (predictor/ensemble.py):
the server serves whatever folder it is given.  Assembling one from separate
training runs is this study's step (`make-ensemble`), which measured that on
the shipped recipe the seeds agree (smollm2-sharegpt/seed_ensemble.md).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from predictor.model import ADAPTER_SUBDIR, CONFIG_FILE, HEAD_FILE

# What `save_predictor` and `train` leave in an adapter folder (not checkpoints).
_MEMBER_FILES = (ADAPTER_SUBDIR, HEAD_FILE, CONFIG_FILE, "curve.jsonl", "train_summary.json")


def gather_members(sources: Sequence[Path], out: Path) -> list[str]:
    """Copy adapter folders into `out/seed<N>` (N: the seed each was trained with)."""
    names: list[str] = []
    for src in sources:
        meta = json.loads((Path(src) / CONFIG_FILE).read_text())
        name = f"seed{meta.get('train_config', {}).get('seed', len(names))}"
        if name in names:
            raise ValueError(f"{src}: two members trained with the same seed ({name})")
        names.append(name)
        dst = Path(out) / name
        if Path(src).resolve() == dst.resolve():
            continue
        dst.mkdir(parents=True, exist_ok=True)
        for f in _MEMBER_FILES:
            if (Path(src) / f).is_dir():
                shutil.copytree(Path(src) / f, dst / f, dirs_exist_ok=True)
            elif (Path(src) / f).is_file():
                shutil.copy2(Path(src) / f, dst / f)
    return names
