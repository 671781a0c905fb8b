"""Backbone + LoRA + length head (EconoServe §2.3: a LoRA-fine-tuned LLM predicts RL).

The backbone is a causal LM's decoder stack (OPT or Llama family, loaded with
`AutoModel`, so the vocabulary projection, a fifth of SmolLM2's compute per
token, is never run).  LoRA adapters (peft) sit on the attention projections
of the top `lora_layers` layers; the prompt's hidden states (the final ones,
or those of chosen layers, by mean and/or last token) are pooled and a small
MLP head, which also sees the full prompt length (truncation hides it),
predicts the RL either as log-length regression or as a distribution over
32-token bins (one bin = one KV block of EconoServe's setup).  The head may
be an ensemble of MLPs whose distributions are averaged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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


def _mlp(n_in: int, cfg: ModelConfig, n_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(n_in, cfg.head_hidden),
        nn.GELU(),
        nn.Dropout(cfg.head_dropout),
        nn.Linear(cfg.head_hidden, n_out),
    )


class LengthHead(nn.Module):
    """MLPs on [pooled hidden states, scaled log prompt length] -> RL.

    `cfg.n_heads` members share the normalised input; each is trained on its
    own loss, and the prediction is their mixture (mean of bin probabilities,
    or of log lengths for the log head).
    """

    def __init__(self, hidden: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.head
        width = hidden * cfg.pooled_width
        self.norm = nn.LayerNorm(width)
        n_out = 1 if cfg.head == "log" else cfg.n_bins
        self.nets = nn.ModuleList(_mlp(width + 1, cfg, n_out) for _ in range(cfg.n_heads))

    def members(self, pooled: torch.Tensor, prompt_tokens: torch.Tensor) -> torch.Tensor:
        """(B, n_heads) log lengths, or (B, n_heads, n_bins) logits."""
        plen = torch.log1p(prompt_tokens.float()).unsqueeze(-1) / math.log1p(_PLEN_SCALE)
        x = torch.cat([self.norm(pooled.float()), plen], dim=-1)
        out = torch.stack([net(x) for net in self.nets], dim=1)
        return out.squeeze(-1) if self.kind == "log" else out

    def combine(self, members: torch.Tensor) -> torch.Tensor:
        """The mixture, in the single-member format (`decode` reads it)."""
        if self.kind == "log":
            return members.mean(1)
        if members.shape[1] == 1:
            return members[:, 0]
        probs = torch.softmax(members.float(), dim=-1).mean(1)
        return torch.log(probs.clamp(min=1e-12))

    def forward(self, pooled: torch.Tensor, prompt_tokens: torch.Tensor) -> torch.Tensor:
        return self.combine(self.members(pooled, prompt_tokens))

    def init_prior(self, lengths: Sequence[int], cfg: ModelConfig) -> None:
        """Start from the training prior: median (log head) or bin frequencies."""
        if self.kind == "log":
            xs = sorted(lengths)
            prior = torch.full((1,), math.log(max(1, xs[len(xs) // 2])))
        else:
            counts = torch.ones(cfg.n_bins)
            for n in lengths:
                counts[bin_index(n, cfg)] += 1
            prior = torch.log(counts / counts.sum())
        with torch.no_grad():
            for net in self.nets:
                last = net[-1]
                assert isinstance(last, nn.Linear)
                last.bias.copy_(prior)

    def load_compatible(self, state: dict[str, torch.Tensor]) -> None:
        """Load a state dict, including one saved before heads became a list."""
        state = {("nets.0." + k[4:] if k.startswith("net.") else k): v for k, v in state.items()}
        self.load_state_dict(state)


def bin_index(length: int, cfg: ModelConfig) -> int:
    return min(max(length - 1, 0) // cfg.bin_width, cfg.n_bins - 1)


def soft_targets(lengths: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Gaussian label over bin centres (sigma = one bin): neighbouring bins are
    near-misses, not errors, which is what Acc-50/100 score."""
    centres = (torch.arange(cfg.n_bins, dtype=torch.float32, device=lengths.device) + 0.5) * cfg.bin_width
    x = lengths.float().clamp(max=cfg.max_len).unsqueeze(-1)
    logits = -0.5 * ((x - centres) / cfg.bin_width) ** 2
    return torch.softmax(logits, dim=-1)


def member_loss(members: torch.Tensor, lengths: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Mean over ensemble members of each one's loss (`LengthHead.members` output)."""
    if cfg.head == "log":
        # L1 on log length: its minimiser is the conditional median, robust
        # to ShareGPT's long tail; a relative error, like the padding ratio.
        y = torch.log(lengths.float().clamp(min=1.0)).unsqueeze(1)
        return (members - y).abs().mean()
    target = soft_targets(lengths, cfg).unsqueeze(1)
    return -(target * torch.log_softmax(members.float(), dim=-1)).sum(-1).mean()


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Mean over real tokens, or the last real token (right padding)."""
    if how == "last":
        idx = mask.long().sum(1).clamp(min=1) - 1
        return hidden[torch.arange(hidden.shape[0]), idx]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


def pool_many(hiddens: Sequence[torch.Tensor], mask: torch.Tensor, how: str) -> torch.Tensor:
    """Pool each hidden-state tensor ("mean+last": both) and concatenate."""
    hows = ("mean", "last") if how == "mean+last" else (how,)
    return torch.cat([pool(h, mask, w) for h in hiddens for w in hows], dim=-1)


@contextmanager
def captured_layers(backbone: nn.Module, layers: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Outputs of decoder layers `layers` (counted from 1) during a forward pass.

    Hooks on the layer modules rather than `output_hidden_states`: the prefix
    cache swaps the bottom layers for stubs, and the hook on the stub standing
    at layer K reads the cached state, which is that layer's output.
    """
    stack = decoder_layers(backbone)
    got: dict[int, torch.Tensor] = {}

    def hook_for(n: int) -> Any:
        def hook(_mod: nn.Module, _args: Any, output: Any) -> None:
            got[n] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [stack[n - 1].register_forward_hook(hook_for(n)) for n in layers]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def decode(out: torch.Tensor, cfg: ModelConfig, how: str | None = None) -> torch.Tensor:
    """Head output -> point prediction in tokens (float, >= 1)."""
    out = out.detach().float().cpu()  # a few numbers per prompt: decoded on the host
    if cfg.head == "log":
        return out.exp().clamp(1.0, float(cfg.max_len))
    how = how or cfg.decode
    probs = torch.softmax(out, dim=-1)
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
        return_members: bool = False,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": False}
        if inputs_embeds is None:
            kwargs["input_ids"] = input_ids
        else:
            kwargs["inputs_embeds"] = inputs_embeds
        if self.cfg.pool_layers is None:
            hiddens = [self.backbone(**kwargs).last_hidden_state]
        else:
            with captured_layers(self.backbone, self.cfg.pool_layers) as got:
                self.backbone(**kwargs)
            hiddens = [got[n] for n in self.cfg.pool_layers]
        members = self.head.members(pool_many(hiddens, attention_mask, self.cfg.pooling), prompt_tokens)
        return members if return_members else self.head.combine(members)

    def loss(self, members: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """See `member_loss` (`members` from `forward(return_members=True)`)."""
        return member_loss(members, lengths, self.cfg)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def merge_lora(self) -> None:
        """Fold the LoRA update into the layers (serving: plain forwards)."""
        if hasattr(self.backbone, "merge_and_unload"):
            self.backbone = self.backbone.merge_and_unload()


def build_predictor(cfg: ModelConfig, with_lora: bool = True) -> LengthPredictor:
    backbone = load_backbone(cfg)
    check_pool_layers(cfg, backbone)
    if with_lora and (cfg.lora_layers is None or cfg.lora_layers > 0):
        backbone = add_lora(cfg, backbone)
    return LengthPredictor(cfg, backbone)


def check_pool_layers(cfg: ModelConfig, backbone: nn.Module) -> None:
    """Pooled layers must exist and sit at or above the frozen prefix's top."""
    if cfg.pool_layers is None:
        return
    depth = len(decoder_layers(backbone))
    k = frozen_prefix(cfg, depth)
    bad = [n for n in cfg.pool_layers if not max(1, k) <= n <= depth]
    if bad:
        raise ValueError(
            f"pool_layers {list(bad)}: must be within [{max(1, k)}, {depth}] "
            f"(depth {depth}, frozen prefix {k} layers, which the prefix cache replaces)"
        )


def device_of(model: nn.Module) -> torch.device:
    """Where `model` runs (its first parameter's device)."""
    return next(model.parameters()).device


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
    check_pool_layers(cfg, base)
    lora_dir = Path(adapter_dir) / ADAPTER_SUBDIR
    if lora_dir.is_dir():
        base = PeftModel.from_pretrained(base, str(lora_dir), is_trainable=trainable)
    model = LengthPredictor(cfg, base)
    model.head.load_compatible(load_file(str(Path(adapter_dir) / HEAD_FILE)))
    return model
