"""OPT (the seed papers' model family): our forward pass.

Differences from Llama that matter here: learned absolute position
embeddings looked up at `position + 2` (OPT's padding offset), LayerNorm with
bias, ReLU MLP without a gate, biases on every projection, q scaled before
the dot product, an optional `project_in`/`project_out` pair when
`word_embed_proj_dim != hidden_size` (OPT-350m), and
`do_layer_norm_before=False` (post-norm, also OPT-350m).  The lm_head is the
token embedding (tied) unless the config says otherwise.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KVCache
from engine.models.activations import activation
from engine.models.base import (
    CausalLM,
    ForwardBatch,
    WeightLoadError,
    WeightTarget,
    frozen,
)
from engine.pipeline_parallel import SINGLE_STAGE, PipelineStage
from engine.tensor_parallel import SINGLE, TensorParallel

# OPT's position table starts 2 rows in (rows 0 and 1 are legacy padding).
POSITION_OFFSET = 2


class _LayerNorm(nn.Module):
    def __init__(self, dim: int, affine: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.dim = dim
        self.weight = frozen((dim,), dtype, device) if affine else None
        self.bias = frozen((dim,), dtype, device) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, 1e-5)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        d = config.hidden_size
        ffn = tp.split(config.ffn_dim, "MLP columns")
        attn = tp.split(d, "attention columns")
        bias = bool(getattr(config, "enable_bias", True))
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.attn_norm = _LayerNorm(d, affine, dtype, device)
        self.qkv = frozen((3 * attn, d), dtype, device)
        self.qkv_bias = frozen((3 * attn,), dtype, device) if bias else None
        self.out = frozen((d, attn), dtype, device)
        self.out_bias = frozen((d,), dtype, device) if bias else None
        self.ffn_norm = _LayerNorm(d, affine, dtype, device)
        self.fc1 = frozen((ffn, d), dtype, device)
        self.fc1_bias = frozen((ffn,), dtype, device) if bias else None
        self.fc2 = frozen((d, ffn), dtype, device)
        self.fc2_bias = frozen((d,), dtype, device) if bias else None


class OPTForCausalLM(CausalLM):
    model_type = "opt"
    projection_names = ("qkv", "out", "fc1", "fc2", "project_in", "project_out")
    tp_split = {"qkv": 0, "qkv_bias": 0, "out": 1, "fc1": 0, "fc1_bias": 0, "fc2": 1,
                "embed": 0, "lm_head": 0}
    tp_vocab = frozenset({"embed", "lm_head"})

    def __init__(
        self, config: Any, dtype: torch.dtype, device: torch.device, max_model_len: int,
        tp: TensorParallel = SINGLE, pp: PipelineStage = SINGLE_STAGE,
    ) -> None:
        super().__init__(config, dtype, device, tp, pp)
        if max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds OPT's learned position table "
                f"({config.max_position_embeddings} positions)"
            )
        d = config.hidden_size
        proj = config.word_embed_proj_dim
        # This shard's heads (all of them without tensor parallelism).
        self.num_heads = tp.split(config.num_attention_heads, "attention heads")
        self.num_kv_heads = self.num_heads
        self.head_dim = d // config.num_attention_heads
        self.vocab_size = config.vocab_size
        vocab_rows = tp.vocab_part(self.vocab_size)[1]
        self.scale = self.head_dim**-0.5
        self.pre_norm = bool(config.do_layer_norm_before)
        self.act = activation(config.activation_function)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))

        # With pipeline stages: the embeddings on the first, the final norm,
        # projection and head on the last (a tied head is the embedding).
        first, last = pp.first, pp.last
        self.embed = frozen((vocab_rows, proj), dtype, device) \
            if first or (last and self.tied) else None
        self.embed_positions = frozen(
            (config.max_position_embeddings + POSITION_OFFSET, d), dtype, device
        ) if first else None
        self.project_in = frozen((d, proj), dtype, device) if proj != d and first else None
        self.project_out = frozen((proj, d), dtype, device) if proj != d and last else None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, dtype, device, tp) for _ in self.layer_range
        )
        keep_final = self.pre_norm and not getattr(config, "_remove_final_layer_norm", False)
        self.final_norm = _LayerNorm(d, affine, dtype, device) if keep_final and last else None
        self.lm_head = None if self.tied or not last else frozen((vocab_rows, proj), dtype,
                                                                 device)

    # Weights ----------------------------------------------------------

    _LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
    _LAYER_NAMES: dict[str, WeightTarget] = {
        "self_attn_layer_norm.weight": WeightTarget("attn_norm.weight"),
        "self_attn_layer_norm.bias": WeightTarget("attn_norm.bias"),
        "self_attn.q_proj.weight": WeightTarget("qkv", 0),
        "self_attn.k_proj.weight": WeightTarget("qkv", 1),
        "self_attn.v_proj.weight": WeightTarget("qkv", 2),
        "self_attn.q_proj.bias": WeightTarget("qkv_bias", 0),
        "self_attn.k_proj.bias": WeightTarget("qkv_bias", 1),
        "self_attn.v_proj.bias": WeightTarget("qkv_bias", 2),
        "self_attn.out_proj.weight": WeightTarget("out"),
        "self_attn.out_proj.bias": WeightTarget("out_bias"),
        "final_layer_norm.weight": WeightTarget("ffn_norm.weight"),
        "final_layer_norm.bias": WeightTarget("ffn_norm.bias"),
        "fc1.weight": WeightTarget("fc1"),
        "fc1.bias": WeightTarget("fc1_bias"),
        "fc2.weight": WeightTarget("fc2"),
        "fc2.bias": WeightTarget("fc2_bias"),
    }
    _TOP_NAMES: dict[str, WeightTarget] = {
        "decoder.embed_tokens.weight": WeightTarget("embed"),
        "decoder.embed_positions.weight": WeightTarget("embed_positions"),
        "decoder.project_in.weight": WeightTarget("project_in"),
        "decoder.project_out.weight": WeightTarget("project_out"),
        "decoder.final_layer_norm.weight": WeightTarget("final_norm.weight"),
        "decoder.final_layer_norm.bias": WeightTarget("final_norm.bias"),
    }

    def weight_target(self, hf_name: str) -> WeightTarget | None:
        if hf_name == "lm_head.weight":
            return None if self.lm_head is None else WeightTarget("lm_head")
        # OPTForCausalLM checkpoints say "model.decoder.", the original
        # facebook/opt-* releases (saved from OPTModel) just "decoder.".
        name = hf_name.removeprefix("model.")
        target = self._TOP_NAMES.get(name)
        if target is not None:
            if self.pp.enabled and getattr(self, target.param.split(".")[0]) is None:
                return None  # another pipeline stage's
            return target
        m = self._LAYER.match(name)
        if m:
            target = self._LAYER_NAMES.get(m.group(2))
            if target is not None:
                layer = self.stage_layer(int(m.group(1)))
                if layer is None:
                    return None
                return WeightTarget(f"layers.{layer}.{target.param}", target.shard)
        raise WeightLoadError(f"unexpected OPT checkpoint tensor {hf_name!r}")

    def fused_shards(self, param: str) -> list[int]:
        if param.rsplit(".", 1)[-1] in ("qkv", "qkv_bias"):
            d = self.num_heads * self.head_dim  # this shard's
            return [d, d, d]
        return super().fused_shards(param)

    # Forward ----------------------------------------------------------

    def forward(self, batch: ForwardBatch, kv_cache: KVCache,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        assert self.attn is not None, "set_attention_backend() first"
        t = batch.input_ids.shape[0]
        h_, hd = self.num_heads, self.head_dim
        d = h_ * hd  # this shard's attention width
        if hidden is None:
            x = self.tp.embed(batch.input_ids, self.embed)
            if self.project_in is not None:
                x = self.linear(x, self.project_in)
            x = x + F.embedding(batch.positions + POSITION_OFFSET, self.embed_positions)
        else:
            x = hidden
        lora = batch.lora
        for i, layer in enumerate(self.layers):
            residual = x
            if self.pre_norm:
                x = layer.attn_norm(x)
            qkv = self.project(lora, i, "qkv", x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split(d, dim=-1)
            # The reference scales q before the product, not the scores.
            q = (q * self.scale).view(t, h_, hd)
            a = self.attn.forward(
                q, k.view(t, h_, hd), v.view(t, h_, hd),
                kv_cache.key(i), kv_cache.value(i), batch.attn_metadata, 1.0,
            )
            x = residual + self.project(lora, i, "out", a.view(t, d), layer.out, layer.out_bias,
                                        row=True)
            if not self.pre_norm:
                x = layer.attn_norm(x)
            residual = x
            if self.pre_norm:
                x = layer.ffn_norm(x)
            x = self.act(self.project(lora, i, "fc1", x, layer.fc1, layer.fc1_bias))
            x = residual + self.project(lora, i, "fc2", x, layer.fc2, layer.fc2_bias, row=True)
            if not self.pre_norm:
                x = layer.ffn_norm(x)
            self.safepoint(i)
        if not self.pp.last:
            return x
        x = x[batch.logits_indices]
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.linear(x, self.project_out)
        return x

    def head_weight(self) -> torch.Tensor | None:
        return self.embed if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.vocab_logits(hidden, self.head_weight())
