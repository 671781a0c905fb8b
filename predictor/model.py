"""Backbone + LoRA + length head (EconoServe §2.3: a LoRA-fine-tuned LLM predicts RL).

The backbone is a causal LM's decoder stack (OPT or Llama family, loaded with
`AutoModel`, so the vocabulary projection, a fifth of SmolLM2's compute per
token, is never run).  LoRA adapters (peft) sit on the attention projections
of the top `lora_layers` layers; the prompt's hidden states are pooled and a
small MLP head, which also sees the full prompt length (truncation hides it),
predicts the RL either as log-length regression or as a distribution over
32-token bins (one bin = one KV block of EconoServe's setup).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from predictor.config import ModelConfig

# Attention projections per family: LoRA on attention (Hu et al. 2022; the
# EconoServe predictor [23] fine-tunes with LoRA, §2.3).
_ATTN_TARGETS: dict[str, list[str]] = {
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "granite", "olmo", "olmo2"}

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# The length feature: log1p(prompt tokens) / log1p(_PLEN_SCALE) is ~1 for long prompts.
_PLEN_SCALE = 4096.0


def family_of(config: Any) -> str:
    mt = getattr(config, "model_type", "")
    if mt == "opt":
        return "opt"
    if mt in _LLAMA_LIKE:
        return "llama"
    raise ValueError(f"unsupported backbone model_type {mt!r} (OPT or Llama family)")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder stack (`layers` of Llama, `decoder.layers` of OPT)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("layers", "decoder.layers"):
        obj: Any = base
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"no decoder layer list found in {type(base).__name__}")


def load_backbone(cfg: ModelConfig) -> nn.Module:
    """`AutoModel` of the backbone, cut to `cfg.depth` layers, frozen."""
    from transformers import AutoModel

    from engine.model_source import resolve_model

    path = resolve_model(cfg.backbone)
    model = AutoModel.from_pretrained(str(path), dtype=_TORCH_DTYPES[cfg.dtype])
    family_of(model.config)
    layers = decoder_layers(model)
    if cfg.depth is not None and cfg.depth < len(layers):
        del layers[cfg.depth :]
        # Llama iterates `layers[: config.num_hidden_layers]`.
        model.config.num_hidden_layers = cfg.depth
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[: cfg.depth]
    for p in model.parameters():
        p.requires_grad_(False)
    model.config.use_cache = False
    return model


def n_layers(cfg: ModelConfig, backbone: nn.Module) -> int:
    return len(decoder_layers(backbone))


def frozen_prefix(cfg: ModelConfig, depth: int) -> int:
    """Number of bottom layers without LoRA (their outputs can be cached)."""
    if cfg.lora_layers is None or cfg.lora_layers >= depth:
        return 0
    return depth - max(0, cfg.lora_layers)


def add_lora(cfg: ModelConfig, backbone: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    depth = len(decoder_layers(backbone))
    start = frozen_prefix(cfg, depth)
    lcfg = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=_ATTN_TARGETS[family_of(backbone.config)],
        layers_to_transform=list(range(start, depth)) if start else None,
        layers_pattern="layers" if start else None,
        bias="none",
    )
    return get_peft_model(backbone, lcfg)


class LengthHead(nn.Module):
    """MLP on [pooled hidden state, scaled log prompt length] -> RL."""

    def __init__(self, hidden: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.head
        self.norm = nn.LayerNorm(hidden)
        n_out = 1 if cfg.head == "log" else cfg.n_bins
        self.net = nn.Sequential(
            nn.Linear(hidden + 1, cfg.head_hidden),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(cfg.head_hidden, n_out),
        )

    def forward(self, pooled: torch.Tensor, prompt_tokens: torch.Tensor) -> torch.Tensor:
        plen = torch.log1p(prompt_tokens.float()).unsqueeze(-1) / math.log1p(_PLEN_SCALE)
        x = torch.cat([self.norm(pooled.float()), plen], dim=-1)
        out = self.net(x)
        return out.squeeze(-1) if self.kind == "log" else out

    def init_prior(self, lengths: Sequence[int], cfg: ModelConfig) -> None:
        """Start from the training prior: median (log head) or bin frequencies."""
        last = self.net[-1]
        assert isinstance(last, nn.Linear)
        with torch.no_grad():
            if self.kind == "log":
                xs = sorted(lengths)
                last.bias.fill_(math.log(max(1, xs[len(xs) // 2])))
            else:
                counts = torch.ones(cfg.n_bins)
                for n in lengths:
                    counts[bin_index(n, cfg)] += 1
                last.bias.copy_(torch.log(counts / counts.sum()))


def bin_index(length: int, cfg: ModelConfig) -> int:
    return min(max(length - 1, 0) // cfg.bin_width, cfg.n_bins - 1)


def soft_targets(lengths: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Gaussian label over bin centres (sigma = one bin): neighbouring bins are
    near-misses, not errors, which is what Acc-50/100 score."""
    centres = (torch.arange(cfg.n_bins, dtype=torch.float32) + 0.5) * cfg.bin_width
    x = lengths.float().clamp(max=cfg.max_len).unsqueeze(-1)
    logits = -0.5 * ((x - centres) / cfg.bin_width) ** 2
    return torch.softmax(logits, dim=-1)


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Mean over real tokens, or the last real token (right padding)."""
    if how == "last":
        idx = mask.long().sum(1).clamp(min=1) - 1
        return hidden[torch.arange(hidden.shape[0]), idx]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


def decode(out: torch.Tensor, cfg: ModelConfig, how: str | None = None) -> torch.Tensor:
    """Head output -> point prediction in tokens (float, >= 1)."""
    if cfg.head == "log":
        return out.float().exp().clamp(1.0, float(cfg.max_len))
    how = how or cfg.decode
    probs = torch.softmax(out.float(), dim=-1)
    w = float(cfg.bin_width)
    if how == "mean":
        centres = (torch.arange(cfg.n_bins, dtype=torch.float32) + 0.5) * w
        return (probs * centres).sum(-1).clamp(min=1.0)
    # Piecewise-linear CDF over bin edges (uniform mass inside a bin).
    cdf = torch.cat([torch.zeros(probs.shape[0], 1), probs.cumsum(-1)], dim=-1)
    edges = torch.arange(cfg.n_bins + 1, dtype=torch.float32) * w

    def cdf_at(x: torch.Tensor) -> torch.Tensor:
        x = x.clamp(0.0, float(edges[-1]))
        i = (x / w).floor().long().clamp(max=cfg.n_bins - 1)
        lo = torch.gather(cdf, 1, i)
        hi = torch.gather(cdf, 1, i + 1)
        return lo + (hi - lo) * (x - i.float() * w) / w

    if how == "median":
        # Bisection on the monotone CDF for F(x) = 0.5 (MAE-optimal point).
        lo = torch.zeros(probs.shape[0], 1)
        hi = torch.full((probs.shape[0], 1), float(edges[-1]))
        for _ in range(30):
            mid = (lo + hi) / 2
            below = cdf_at(mid) < 0.5
            lo = torch.where(below, mid, lo)
            hi = torch.where(below, hi, mid)
        return ((lo + hi) / 2).squeeze(-1).clamp(min=1.0)
    # "window": centre of the +-50-token window holding the most mass, i.e. the
    # point that maximises the predicted probability of an Acc-50 hit.
    grid = torch.arange(1.0, float(edges[-1]) + 1.0, 4.0)
    g = grid.unsqueeze(0).expand(probs.shape[0], -1)
    mass = cdf_at(g + 50.0) - cdf_at(g - 50.0)
    return grid[mass.argmax(-1)].clamp(min=1.0)


class LengthPredictor(nn.Module):
    """Backbone (with LoRA) + pooling + head."""

    def __init__(self, cfg: ModelConfig, backbone: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = backbone
        self.head = LengthHead(int(backbone.config.hidden_size), cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_tokens: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": False}
        if inputs_embeds is None:
            kwargs["input_ids"] = input_ids
        else:
            kwargs["inputs_embeds"] = inputs_embeds
        hidden = self.backbone(**kwargs).last_hidden_state
        return self.head(pool(hidden, attention_mask, self.cfg.pooling), prompt_tokens)

    def loss(self, out: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self.cfg.head == "log":
            # L1 on log length: its minimiser is the conditional median, robust
            # to ShareGPT's long tail; a relative error, like the padding ratio.
            return (out - torch.log(lengths.float().clamp(min=1.0))).abs().mean()
        target = soft_targets(lengths, self.cfg)
        return -(target * torch.log_softmax(out.float(), dim=-1)).sum(-1).mean()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def build_predictor(cfg: ModelConfig, with_lora: bool = True) -> LengthPredictor:
    backbone = load_backbone(cfg)
    if with_lora and (cfg.lora_layers is None or cfg.lora_layers > 0):
        backbone = add_lora(cfg, backbone)
    return LengthPredictor(cfg, backbone)


def collate(
    ids: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batch: real tokens never attend to pads under a causal mask,
    so a prompt's hidden states do not depend on its batch (cacheable)."""
    n = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), n), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = torch.tensor(list(x), dtype=torch.long)
        mask[i, : len(x)] = 1
    return input_ids, mask


def pad_id_of(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


# ------------------------------------------------------------- persistence

ADAPTER_SUBDIR = "lora"
HEAD_FILE = "head.safetensors"
CONFIG_FILE = "predictor_config.json"


def save_predictor(model: LengthPredictor, out_dir: Path, extra: dict[str, Any] | None = None) -> None:
    """LoRA weights (peft format) + head + config: everything but the backbone."""
    import json

    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    if hasattr(model.backbone, "save_pretrained") and hasattr(model.backbone, "peft_config"):
        model.backbone.save_pretrained(str(out_dir / ADAPTER_SUBDIR))
        # peft records the resolved local path of the base; record the
        # portable spec instead (the folder is machine-specific).
        acfg_path = out_dir / ADAPTER_SUBDIR / "adapter_config.json"
        acfg = json.loads(acfg_path.read_text())
        acfg["base_model_name_or_path"] = model.cfg.backbone
        acfg_path.write_text(json.dumps(acfg, indent=2) + "\n")
        (out_dir / ADAPTER_SUBDIR / "README.md").unlink(missing_ok=True)  # peft's empty model card
    save_file({k: v.detach().contiguous().cpu() for k, v in model.head.state_dict().items()},
              str(out_dir / HEAD_FILE))
    meta = {"model": model.cfg.model_dump(), **(extra or {})}
    (out_dir / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_model_config(adapter_dir: Path) -> ModelConfig:
    import json

    meta = json.loads((Path(adapter_dir) / CONFIG_FILE).read_text())
    return ModelConfig.model_validate(meta["model"])


def load_predictor(
    adapter_dir: Path, backbone: str | None = None, trainable: bool = False
) -> LengthPredictor:
    """Rebuild a predictor from `save_predictor` output (backbone from config, or overridden)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    cfg = read_model_config(adapter_dir)
    if backbone is not None:
        cfg = cfg.model_copy(update={"backbone": backbone})
    base = load_backbone(cfg)
    lora_dir = Path(adapter_dir) / ADAPTER_SUBDIR
    if lora_dir.is_dir():
        base = PeftModel.from_pretrained(base, str(lora_dir), is_trainable=trainable)
    model = LengthPredictor(cfg, base)
    model.head.load_state_dict(load_file(str(Path(adapter_dir) / HEAD_FILE)))
    return model
