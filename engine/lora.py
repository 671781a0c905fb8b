"""LoRA adapters served beside the base model: each request runs with the
base weights or with one adapter, and one pass mixes them.

An adapter is a PEFT LoRA folder (`adapter_config.json`, and
`adapter_model.safetensors` or `adapter_model.bin`) trained on this base
model.  Its low-rank pairs are loaded onto the projections they target:
q/k/v and gate/up, which the models fuse into one matrix, get one pair
each, A the adapter's A matrices stacked and B theirs block-diagonally, so
a fused projection's delta is two matmuls as an unfused one's.  In a pass,
the rows of each adapter's requests get their delta, `scaling · B(A x)`
(the scaling folded into B at load), added to the base projection's output,
as PEFT's `lora.Linear` adds it
(LoRA, Hu et al. 2021, §4.1; rsLoRA's `alpha / √r` where the adapter says
`use_rslora`).  Rows of the base model get nothing: a pass with no adapter
rows runs exactly as without adapters.

Served: LoRA (not DoRA) on the layers' projections, without bias terms or
`modules_to_save`, one rank and alpha for all modules; anything else is
refused at load, by name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.models.prepacked import projection_shape

if TYPE_CHECKING:
    from engine.models.base import CausalLM
    from engine.models.linear import LinearFn

_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
_PARAM = re.compile(r"^layers\.(\d+)\.(\w+)$")
# Settings that change what a LoRA module computes: refused unless off.
_OFF = {"use_dora": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
        "fan_in_fan_out": (False, None), "rank_pattern": ({}, None),
        "alpha_pattern": ({}, None), "layer_replication": (None, []),
        "lora_bias": (False, None)}


class AdapterError(ValueError):
    """An adapter that cannot be served on this model."""


@dataclass
class Adapter:
    name: str
    # (layer index of this model, projection) -> (A [rank, in], B [out, rank]),
    # B scaled (in float32, before the cast to the model's dtype).
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)


def load_adapters(paths: dict[str, str], model: CausalLM, world: int = 1
                  ) -> dict[str, Adapter]:
    """The adapters at `paths` (name -> folder) on `model`, one shard of
    `world` (more than one is refused)."""
    if paths and world > 1:
        raise AdapterError("LoRA adapters are not served with tensor or pipeline parallelism")
    with torch.no_grad():
        return {name: load_adapter(name, path, model) for name, path in paths.items()}


def load_adapter(name: str, path: str | Path, model: CausalLM) -> Adapter:
    """Read the adapter at `path` onto `model`'s projections."""
    folder = Path(path).expanduser()
    cfg = _config(name, folder)
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be at least 1, not {rank}")
    scaling = alpha / rank ** 0.5 if cfg.get("use_rslora") else alpha / rank
    adapter = Adapter(name)
    # (param, shard) -> {"A": tensor, "B": tensor}
    found: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    for key, tensor in _tensors(name, folder).items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A or B "
                               "matrix (only LoRA on the layers' projections is served)")
        module, which = m.groups()
        try:
            target = model.weight_target(f"{module}.weight")
        except ValueError as e:
            raise AdapterError(f"adapter {name!r}: {e}") from None
        if target is None:
            continue  # another pipeline stage's layer
        pm = _PARAM.match(target.param)
        if pm is None or pm.group(2) not in model.projection_names:
            raise AdapterError(f"adapter {name!r}: LoRA on {module!r} is not served "
                               "(only on the layers' projections)")
        found.setdefault((target.param, target.shard), {})[which] = tensor
    by_param: dict[str, dict[int | None, dict[str, torch.Tensor]]] = {}
    for (param, shard), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {param} has lora_A or lora_B, not both")
        by_param.setdefault(param, {})[shard] = ab
    weights = dict(model.named_parameters())
    for param, shards in by_param.items():
        pm = _PARAM.match(param)
        assert pm is not None
        # The packed layouts of our GEMMs hide the weight's shape in theirs.
        out_rows, in_features = projection_shape(weights[param])
        a, b = _fused(name, param, shards, model, out_rows, in_features)
        adapter.pairs[(int(pm.group(1)), pm.group(2))] = (
            a.to(model.device, model.dtype).contiguous(),
            (b * scaling).to(model.device, model.dtype).contiguous())
    if not adapter.pairs:
        raise AdapterError(f"adapter {name!r} holds no LoRA weights for this model")
    return adapter


def _config(name: str, folder: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {folder}/adapter_config.json: "
                           f"{e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not "
                           "served (LORA only)")
    for key, off in _OFF.items():
        if cfg.get(key) not in off:
            raise AdapterError(f"adapter {name!r}: {key}={cfg.get(key)!r} is not served")
    if "r" not in cfg:
        raise AdapterError(f"adapter {name!r}: adapter_config.json has no r")
    return cfg


def _tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    safe, pickled = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if safe.exists():
        from safetensors.torch import load_file

        return load_file(str(safe))
    if pickled.exists():
        return torch.load(pickled, map_location="cpu", weights_only=True)
    raise AdapterError(f"adapter {name!r}: no adapter_model.safetensors or "
                       f"adapter_model.bin in {folder}")


def _fused(name: str, param: str, shards: dict[int | None, dict[str, torch.Tensor]],
           model: CausalLM, out_rows: int, in_features: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) for a projection: a fused one's targeted parts stacked
    in A, their B placed block-diagonally at their rows (zeros elsewhere)."""
    sizes = model.fused_shards(param) if None not in shards else [out_rows]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    order = sorted(shards, key=lambda s: -1 if s is None else s)
    ranks = [shards[s]["A"].shape[0] for s in order]
    a = torch.zeros(sum(ranks), in_features, dtype=torch.float32)
    b = torch.zeros(out_rows, sum(ranks), dtype=torch.float32)
    col = 0
    for s, r in zip(order, ranks):
        part_a, part_b = shards[s]["A"], shards[s]["B"]
        rows = sizes[0 if s is None else s]
        start = offsets[0 if s is None else s]
        if tuple(part_a.shape) != (r, in_features) or tuple(part_b.shape) != (rows, r):
            raise AdapterError(
                f"adapter {name!r}: {param} LoRA shapes A {tuple(part_a.shape)}, B "
                f"{tuple(part_b.shape)} do not fit a [{rows}, {in_features}] projection "
                "(an adapter of another base model?)")
        a[col:col + r] = part_a.float()
        b[start:start + rows, col:col + r] = part_b.float()
        col += r
    return a, b


class LoraStep:
    """One pass's adapters: the rows of each, and how to add their deltas.
    `fused`: `linear` is the plain matmul, so the delta of an adapter that
    has every row is added by the same GEMM (`addmm`: 1.1-6x faster than
    a product then a sum on CPU, most for prefill rows); otherwise (the
    fixed tiles of deterministic mode, emulated bfloat16) two `linear`s
    and a sum."""

    def __init__(self, groups: list[tuple[Adapter, torch.Tensor | None]],
                 linear: LinearFn, fused: bool = False) -> None:
        # (adapter, its rows; None: every row of the pass).
        self.groups = groups
        self.linear = linear
        self.fused = fused

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base projection of `x`) with each adapter's delta added
        on its rows."""
        for adapter, rows in self.groups:
            pair = adapter.pairs.get((layer, proj))
            if pair is None:
                continue
            a, b = pair
            xs = x if rows is None else x.index_select(0, rows)
            if self.fused and rows is None:
                y = torch.addmm(y, self.linear(xs, a), b.t())
                continue
            delta = self.linear(self.linear(xs, a), b)
            y = y + delta if rows is None else y.index_add(0, rows, delta)
        return y
