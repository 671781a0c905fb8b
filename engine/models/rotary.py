"""Rotary position embedding (RoPE) as the Llama family uses it.

The inverse frequencies come from the config's `rope_parameters` (or the
older `rope_theta` / `rope_scaling` fields).  Scaled variants whose
frequencies are fixed at load time (linear, llama3, yarn, proportional) take
theirs from `transformers.modeling_rope_utils`, so they match the reference
by construction; variants that change with the running sequence length
(dynamic NTK, longrope) are refused rather than silently approximated.

cos/sin are tabulated once for all positions up to `max_positions` in
float32 and cast to the model dtype, as the reference does.
"""

from __future__ import annotations

from typing import Any

import torch

_STATIC_SCALED = ("linear", "llama3", "yarn", "proportional")


def rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    # transformers < 5 kept these as separate fields.
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def inv_freq_and_scale(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params["rope_theta"])
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exps), 1.0
    if rope_type in _STATIC_SCALED:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv_freq.float(), float(scale)
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported (frequencies that depend on the "
        f"running sequence length); supported: default, {', '.join(_STATIC_SCALED)}"
    )


class RotaryEmbedding:
    def __init__(
        self, config: Any, head_dim: int, max_positions: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq, scale = inv_freq_and_scale(config, head_dim)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.max_positions = max_positions
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale).to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, 1, head_dim]` tables for tokens at `positions`."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `[T, heads, head_dim]` by the half-split convention of HF Llama."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
