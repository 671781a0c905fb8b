"""Reading checkpoint tensors from a local Hugging Face folder.

Yields `(hf_name, tensor)` pairs one at a time, so that a model maps each to
its own parameter (renaming, fusing q/k/v) without the whole checkpoint being
materialised twice.  safetensors is preferred; `pytorch_model*.bin` is read
as a fallback because many OPT releases only ship those.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


class WeightsNotFound(FileNotFoundError):
    pass


def _shards(folder: Path, single: str, index: str) -> list[Path]:
    if (folder / index).is_file():
        weight_map = json.loads((folder / index).read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / single).is_file():
        return [folder / single]
    return []


def checkpoint_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    files = _shards(folder, "model.safetensors", "model.safetensors.index.json")
    if files:
        return files
    files = _shards(folder, "pytorch_model.bin", "pytorch_model.bin.index.json")
    if files:
        return files
    raise WeightsNotFound(f"no safetensors or pytorch_model.bin checkpoint in {folder}")


def iter_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(folder):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
