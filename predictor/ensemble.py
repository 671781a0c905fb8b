"""Several trained adapters on one backbone, averaged: a LoRA-seed ensemble.

Each member is a full adapter (its own LoRA top layers and head), trained by
the same command with another `--seed`.  The members share the backbone and
its frozen prefix (the layers under the LoRA ones), so a prediction runs that
prefix once and only each member's top layers per member: with 16 frozen and
8 LoRA layers, two members cost 32 layer passes instead of 48.  Their bin
distributions are averaged, like the heads inside one adapter
(`LengthHead.combine`), which removes what a fine-tune owes to its seed.  On
the shipped recipe the seeds agree and three members gain 0.1 token of MAE
(studies/predictor/smollm2-sharegpt/seed_ensemble.md), so the shipped
predictor is one adapter; an ensemble pays off for members that differ.

On disk an ensemble is a folder holding `ensemble.json` (the member folders,
relative to it) and the members, each a folder `save_predictor` wrote.  The
server and `evaluate` load one wherever they take an adapter, and `retrain`
retrains each member; `python -m studies.predictor make-ensemble` assembles one
from adapters trained with other seeds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from predictor.config import ModelConfig
from predictor.model import (
    CONFIG_FILE,
    LengthPredictor,
    decoder_layers,
    frozen_prefix,
    load_predictor,
    n_layers,
)
from predictor.prefix_cache import injected, prefix_states

ENSEMBLE_FILE = "ensemble.json"

# What members must agree on: the same ids reach the same frozen prefix, and
# their outputs mean the same bins.
_SHARED_FIELDS = (
    "backbone", "depth", "lora_layers", "prompt_head", "prompt_tail", "prompt_format",
    "dtype", "head", "bin_width", "max_len",
)


class EnsembleSpec(BaseModel):
    """`ensemble.json`: member folders, relative to the ensemble's folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    members: list[str] = Field(min_length=1)
    commands: list[str] = []


class PredictorEnsemble(nn.Module):
    """Members that share a backbone's frozen prefix; outputs averaged."""

    def __init__(self, members: Sequence[LengthPredictor]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        first = members[0].cfg
        for i, m in enumerate(members[1:], start=1):
            diff = [f for f in _SHARED_FIELDS if getattr(m.cfg, f) != getattr(first, f)]
            if diff:
                raise ValueError(f"ensemble member {i} differs from member 0 in {diff}")
        self.members = nn.ModuleList(members)
        self.cfg: ModelConfig = first
        self.k = frozen_prefix(first, n_layers(first, members[0].backbone))
        # The prefix runs in member 0 only: the others point at its (frozen,
        # identical) layers instead of holding copies.
        base = decoder_layers(members[0].backbone)
        for m in members[1:]:
            layers = decoder_layers(m.backbone)
            for j in range(self.k):
                layers[j] = base[j]

    @property
    def backbone(self) -> nn.Module:
        """The backbone that runs the shared prefix (member 0's)."""
        return self.members[0].backbone

    def combine(self, outs: Sequence[torch.Tensor]) -> torch.Tensor:
        # Each member's output is already its heads' mixture (log-probabilities,
        # or a log length); mixing those is what mixes heads inside an adapter.
        return self.members[0].head.combine(torch.stack(list(outs), dim=1))

    def from_prefix(
        self,
        states: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """Average of the members run on the shared prefix's output `states`."""
        outs = []
        for m in self.members:
            with injected(m.backbone, self.k, states):
                outs.append(m(input_ids, attention_mask, prompt_tokens))
        return self.combine(outs)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_tokens: torch.Tensor
    ) -> torch.Tensor:
        if self.k == 0:
            return self.combine([m(input_ids, attention_mask, prompt_tokens) for m in self.members])
        states = prefix_states(self.backbone, self.k, input_ids, attention_mask)
        return self.from_prefix(states, input_ids, attention_mask, prompt_tokens)

    def merge_lora(self) -> None:
        """Fold each member's LoRA into its layers (serving: plain forwards)."""
        for m in self.members:
            m.merge_lora()


Predictor = LengthPredictor | PredictorEnsemble


def run_on_prefix(
    model: Predictor,
    k: int,
    states: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_tokens: torch.Tensor,
) -> torch.Tensor:
    """`model`'s output with its bottom `k` layers replaced by cached `states`."""
    if isinstance(model, PredictorEnsemble):
        if k != model.k:
            raise ValueError(f"prefix cache of {k} layers for an ensemble whose prefix is {model.k}")
        return model.from_prefix(states, input_ids, attention_mask, prompt_tokens)
    with injected(model.backbone, k, states):
        return model(input_ids, attention_mask, prompt_tokens)


def is_ensemble(path: Path) -> bool:
    return (Path(path) / ENSEMBLE_FILE).is_file()


def read_spec(path: Path) -> EnsembleSpec:
    return EnsembleSpec.model_validate_json((Path(path) / ENSEMBLE_FILE).read_text())


def member_dirs(path: Path) -> list[Path]:
    """Member folders of an ensemble, or `[path]` for a single adapter."""
    path = Path(path)
    if not is_ensemble(path):
        return [path]
    return [path / m for m in read_spec(path).members]


def adapter_meta(path: Path) -> dict[str, Any]:
    """The first member's `predictor_config.json` (tokenizer provenance, config)."""
    return json.loads((member_dirs(path)[0] / CONFIG_FILE).read_text())


def load_any(path: Path, backbone: str | None = None) -> Predictor:
    """A single adapter folder, or an ensemble folder (`ensemble.json`)."""
    if not is_ensemble(Path(path)):
        return load_predictor(Path(path), backbone=backbone)
    return PredictorEnsemble([load_predictor(d, backbone=backbone) for d in member_dirs(Path(path))])


def write_ensemble(path: Path, members: Sequence[str], commands: Sequence[str] = ()) -> Path:
    """Write `ensemble.json`; `members` are folders relative to `path`."""
    path = Path(path)
    missing = [m for m in members if not (path / m / CONFIG_FILE).is_file()]
    if missing:
        raise ValueError(f"ensemble members without {CONFIG_FILE}: {missing}")
    spec = EnsembleSpec(members=list(members), commands=list(commands))
    (path / ENSEMBLE_FILE).write_text(json.dumps(spec.model_dump(), indent=2) + "\n")
    return path / ENSEMBLE_FILE


def train_commands(path: Path) -> list[str]:
    """The commands that produced an adapter (every member's, then the ensemble's)."""
    out: list[str] = []
    for d in member_dirs(Path(path)):
        meta = json.loads((d / CONFIG_FILE).read_text())
        out += meta.get("commands") or ([meta["command"]] if meta.get("command") else [])
    if is_ensemble(Path(path)):
        out += read_spec(Path(path)).commands
    return out
