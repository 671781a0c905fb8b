"""The Llama family (Llama 2/3, SmolLM, TinyLlama, ...): our forward pass.

Pre-norm decoder: RMSNorm → attention with RoPE and grouped-query heads →
residual → RMSNorm → SiLU-gated MLP → residual.  q/k/v are fused into one
matrix at load time (one GEMM and one split instead of three GEMMs: neutral
on a CPU, a win on GPUs), and so are gate and up: on oneDNN-packed bf16
weights read from memory one GEMM of both is 1.05–1.1× the two at 8–96 rows
(studies/engine_cpu/layer_ops.py), level with them in float32 on MKL.  On an
AVX512 CPU (on an AVX2 one in float32), SiLU and the product read the two
halves in one C++ operator (engine/csrc/silu_mul.cpp; in bf16 silu looked up
in a table of its result for each of the 65,536 gates).  On any CPU build
where the operators load, each residual sum is one operator with the norm
that follows it (norm_rotary.cpp): in bf16 with ATen's roundings, the same
bits as the op-by-op forward; in float32 its sum of squares runs in another
order than ATen's, so a value may differ in its last bits.  Where a step's
attention is the C++ decode and prefill operators' on our packed bf16 or
float32 projections (`_layer_args`), each layer is one C++ operator that
calls the same operators in the same order (engine/csrc/decode_layer.cpp):
the same bits again, without Python between them; on bf16 GGUF codes past
64 rows on AMX tiles that operator also takes gate_up's projection and
silu(gate) × up in one pass, never storing the projection's output
(gemm_bf16_codes.cpp, `linear_bf16_codes_silu_mul`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine import attention_cpp
from engine.kv_cache import KVCache
from engine.models import packed_bf16, packed_f32
from engine.models.activations import activation
from engine.models.base import (
    CausalLM,
    ForwardBatch,
    WeightLoadError,
    WeightTarget,
    frozen,
)
from engine.models.rotary import RotaryEmbedding, apply_rotary
from engine.pipeline_parallel import SINGLE_STAGE, PipelineStage
from engine.tensor_parallel import SINGLE, TensorParallel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype is torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Normalise in float32 and scale in the model dtype, as the reference
    # does: the order of rounding matters for bf16 results.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


# The C++ norms' dtypes (engine/csrc/norm_rotary.cpp: rms_norm_<suffix>,
# add_rms_norm_<suffix>).
_CPP_NORM_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _cpp_norm_suffix(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """The C++ norms' suffix for these 2-D rows, where they are loaded."""
    if (weight.dtype is not x.dtype or x.dim() != 2 or x.stride(-1) != 1
            or not attention_cpp.loaded()):
        return None
    return _CPP_NORM_SUFFIX.get(x.dtype)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` by one C++ operator where it is loaded: bfloat16 rows with
    the same rounding; float32 rows with the sum of squares in another order
    than ATen's (a value may differ in its last bits, still per row)."""
    if (suffix := _cpp_norm_suffix(x, weight)) is not None:
        return getattr(torch.ops.preempt_serve, f"rms_norm_{suffix}")(x, weight, eps)
    return rms_norm(x, weight, eps)


def add_rms_norm_cpu(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, its norm): one C++ operator where it is loaded (the add
    rounded as ATen's, then `rms_norm_cpu`)."""
    if r.dtype is x.dtype and r.stride(-1) == 1 and (suffix := _cpp_norm_suffix(x, weight)):
        return getattr(torch.ops.preempt_serve, f"add_rms_norm_{suffix}")(x, r, weight, eps)
    x = x + r
    return x, rms_norm(x, weight, eps)


# Packings whose projections a decoder layer's one operator takes: the
# activations' dtype, whether a weight is in that packed layout, the
# operators' suffix (decode_layer_<suffix>, prefill_layer_<suffix>).
_LAYER_PACKINGS: dict[str, tuple[torch.dtype, Callable[[torch.Tensor], bool], str]] = {
    "bf16_dot": (torch.bfloat16, packed_bf16.multiplies, "bf16"),
    "f32_fma": (torch.float32, packed_f32.is_packed, "f32"),
}


def _bias(n: int, enabled: bool, dtype: torch.dtype, device: torch.device) -> nn.Parameter | None:
    return frozen((n,), dtype, device) if enabled else None


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, num_heads: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        d = config.hidden_size
        inter = tp.split(config.intermediate_size, "MLP columns")
        qkv_rows = (num_heads + 2 * num_kv_heads) * head_dim
        attn_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.input_norm = frozen((d,), dtype, device)
        self.qkv = frozen((qkv_rows, d), dtype, device)
        self.qkv_bias = _bias(qkv_rows, attn_bias, dtype, device)
        self.o = frozen((d, num_heads * head_dim), dtype, device)
        self.o_bias = _bias(d, attn_bias, dtype, device)
        self.post_norm = frozen((d,), dtype, device)
        # gate's rows, then up's (this shard's of each).
        self.gate_up = frozen((2 * inter, d), dtype, device)
        self.gate_up_bias = _bias(2 * inter, mlp_bias, dtype, device)
        self.down = frozen((d, inter), dtype, device)
        self.down_bias = _bias(d, mlp_bias, dtype, device)


class LlamaForCausalLM(CausalLM):
    model_type = "llama"
    projection_names = ("qkv", "o", "gate_up", "down")
    tp_split = {"qkv": 0, "qkv_bias": 0, "o": 1, "gate_up": 0, "gate_up_bias": 0,
                "down": 1, "embed": 0, "lm_head": 0}
    tp_vocab = frozenset({"embed", "lm_head"})

    def __init__(
        self, config: Any, dtype: torch.dtype, device: torch.device, max_model_len: int,
        tp: TensorParallel = SINGLE, pp: PipelineStage = SINGLE_STAGE,
    ) -> None:
        super().__init__(config, dtype, device, tp, pp)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        # This shard's heads (all of them without tensor parallelism).
        self.num_heads = tp.split(heads, "attention heads")
        self.num_kv_heads = tp.split(kv_heads, "key/value heads")
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.vocab_size = config.vocab_size
        vocab_rows = tp.vocab_part(self.vocab_size)[1]
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.act = activation(getattr(config, "hidden_act", "silu"))
        self.tied = bool(getattr(config, "tie_word_embeddings", False))

        # The head of a tied model is the embedding: the last stage holds it too.
        holds_embed = pp.first or (pp.last and self.tied)
        self.embed = frozen((vocab_rows, config.hidden_size), dtype, device) \
            if holds_embed else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, self.num_heads, self.num_kv_heads, self.head_dim, dtype, device, tp
            )
            for _ in self.layer_range
        )
        self.norm = frozen((config.hidden_size,), dtype, device) if pp.last else None
        self.lm_head = None if self.tied or not pp.last else frozen(
            (vocab_rows, config.hidden_size), dtype, device
        )
        self.rotary = RotaryEmbedding(config, self.head_dim, max_model_len, dtype, device)
        # On CUDA each norm and the rotation of q and k are one Triton kernel
        # (engine/models/fused_triton.py) instead of several small ones.
        self.fused = device.type == "cuda"
        self.norm_fn = rms_norm_cpu if device.type == "cpu" else rms_norm
        if self.fused:
            from engine.models import fused_triton

            self.norm_fn = fused_triton.rms_norm
        self._q_size = self.num_heads * self.head_dim
        self._kv_size = self.num_kv_heads * self.head_dim
        self._inter = tp.split(config.intermediate_size, "MLP columns")
        # SiLU(gate) * up: one C++ operator on an AVX512 CPU, and on an AVX2
        # one in float32 (as ATen rounds); elsewhere ATen's.  The residual
        # sums with their norms: one C++ operator on any CPU build where the
        # operators load (bf16: ATen's bits; float32: may differ in the last
        # bits).
        self._silu = getattr(config, "hidden_act", "silu") in ("silu", "swish")
        self.add_norm_fn = add_rms_norm_cpu if device.type == "cpu" else None
        # (packing, whether it packed every projection): `_layer_args`.
        self._layers_packed: tuple[str | None, bool] = (None, False)

    # Weights ----------------------------------------------------------

    _LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
    _LAYER_NAMES: dict[str, WeightTarget] = {
        "input_layernorm.weight": WeightTarget("input_norm"),
        "post_attention_layernorm.weight": WeightTarget("post_norm"),
        "self_attn.q_proj.weight": WeightTarget("qkv", 0),
        "self_attn.k_proj.weight": WeightTarget("qkv", 1),
        "self_attn.v_proj.weight": WeightTarget("qkv", 2),
        "self_attn.q_proj.bias": WeightTarget("qkv_bias", 0),
        "self_attn.k_proj.bias": WeightTarget("qkv_bias", 1),
        "self_attn.v_proj.bias": WeightTarget("qkv_bias", 2),
        "self_attn.o_proj.weight": WeightTarget("o"),
        "self_attn.o_proj.bias": WeightTarget("o_bias"),
        "mlp.gate_proj.weight": WeightTarget("gate_up", 0),
        "mlp.up_proj.weight": WeightTarget("gate_up", 1),
        "mlp.gate_proj.bias": WeightTarget("gate_up_bias", 0),
        "mlp.up_proj.bias": WeightTarget("gate_up_bias", 1),
        "mlp.down_proj.weight": WeightTarget("down"),
        "mlp.down_proj.bias": WeightTarget("down_bias"),
    }

    def weight_target(self, hf_name: str) -> WeightTarget | None:
        # Tensors of other pipeline stages are skipped.
        if hf_name == "model.embed_tokens.weight":
            return None if self.embed is None else WeightTarget("embed")
        if hf_name == "model.norm.weight":
            return None if self.norm is None else WeightTarget("norm")
        if hf_name == "lm_head.weight":
            # Some tied checkpoints store the copy anyway; the embedding wins.
            return None if self.lm_head is None else WeightTarget("lm_head")
        m = self._LAYER.match(hf_name)
        if m:
            if m.group(2).endswith("rotary_emb.inv_freq"):
                return None  # recomputed from the config
            target = self._LAYER_NAMES.get(m.group(2))
            if target is not None:
                layer = self.stage_layer(int(m.group(1)))
                if layer is None:
                    return None
                return WeightTarget(f"layers.{layer}.{target.param}", target.shard)
        raise WeightLoadError(f"unexpected Llama checkpoint tensor {hf_name!r}")

    def fused_shards(self, param: str) -> list[int]:
        leaf = param.rsplit(".", 1)[-1]
        if leaf in ("qkv", "qkv_bias"):
            return [self._q_size, self._kv_size, self._kv_size]
        if leaf in ("gate_up", "gate_up_bias"):
            return [self._inter, self._inter]
        return super().fused_shards(param)

    # Forward ----------------------------------------------------------

    def forward(self, batch: ForwardBatch, kv_cache: KVCache,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        assert self.attn is not None, "set_attention_backend() first"
        t = batch.input_ids.shape[0]
        x = self.tp.embed(batch.input_ids, self.embed) if hidden is None else hidden
        rotate = self._rotation(batch.positions)
        q_size, kv_size = self._q_size, self._kv_size
        norm = self.norm_fn
        # A tuple: ModuleList's len() and indexing are Python calls, twice a
        # layer on every pass.
        layers = tuple(self.layers)
        # Each residual sum goes with the norm after it (`_add_norm`).
        h = norm(x, layers[0].input_norm, self.eps) if layers else x
        lora = batch.lora
        fused = self._layer_args(batch, t)
        if fused is not None:
            x = self._one_op_layers(x, h, layers, kv_cache, *fused)
            return self._final_norm(x, batch)
        for i, layer in enumerate(layers):
            qkv = self.project(lora, i, "qkv", h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q, k = rotate(q.view(t, self.num_heads, self.head_dim),
                          k.view(t, self.num_kv_heads, self.head_dim))
            v = v.view(t, self.num_kv_heads, self.head_dim)
            a = self.attn.forward(
                q, k, v, kv_cache.key(i), kv_cache.value(i), batch.attn_metadata, self.scale
            )
            o = self.project(lora, i, "o", a.view(t, q_size), layer.o, layer.o_bias, row=True)
            x, h = self._add_norm(x, o, layer.post_norm)
            gate_up = self.project(lora, i, "gate_up", h, layer.gate_up, layer.gate_up_bias)
            d = self.project(lora, i, "down", self._gated(gate_up), layer.down,
                             layer.down_bias, row=True)
            if i + 1 < len(layers):
                x, h = self._add_norm(x, d, layers[i + 1].input_norm)
            else:
                x = x + d
            self.safepoint(i)
        return self._final_norm(x, batch)

    def _final_norm(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if not self.pp.last:
            return x
        return self.norm_fn(x[batch.logits_indices], self.norm, self.eps)

    def _layer_args(
        self, batch: ForwardBatch, t: int
    ) -> tuple[Any, list[torch.Tensor | None], tuple[Any, ...]] | None:
        """The one-operator layer for this step, its step tensors (the
        attention's, then the positions) and its last arguments, where every
        layer can be that one operator: on CPU, the projections in our packed
        bfloat16 or float32 layout, SiLU (whose operator runs in vectors
        there), no LoRA or tensor parallelism, and a step that the attention
        answers with its decode operator alone (`decode_layer_*`) or with its
        prefill operator beside it (`prefill_layer_*`)."""
        packed = _LAYER_PACKINGS.get(self.packing)
        if (packed is None or batch.lora is not None or self.tp.enabled
                or not self._silu or self.add_norm_fn is None or self.attn is None
                or batch.positions.device.type != "cpu"
                or not attention_cpp.silu_mul_vectorized(packed[0])):
            return None
        if self._layers_packed[0] != self.packing:
            # Packing leaves a weight of a shape the layout cannot take as it was.
            self._layers_packed = (self.packing, all(
                packed[1](getattr(layer, name))
                for layer in self.layers for name in self.projection_names))
        if not self._layers_packed[1]:
            return None
        ops = torch.ops.preempt_serve
        md = batch.attn_metadata
        decode = self.attn.decode_layer_step(md, t)
        if decode is not None:
            step, tiles = decode
            return (getattr(ops, f"decode_layer_{packed[2]}"), [*step, batch.positions],
                    (tiles,))
        prefill = self.attn.prefill_layer_step(md, t)
        if prefill is None:
            return None
        entries, num_decodes, tiles = prefill
        return (getattr(ops, f"prefill_layer_{packed[2]}"), [*entries, batch.positions],
                (tiles, num_decodes))

    def _one_op_layers(self, x: torch.Tensor, h: torch.Tensor, layers: tuple[Any, ...],
                       kv_cache: KVCache, op: Any, step: list[torch.Tensor | None],
                       last_args: tuple[Any, ...]) -> torch.Tensor:
        """Every layer as one operator each (`_layer_args` says when)."""
        cos, sin = self.rotary.cos, self.rotary.sin
        heads, kv_heads, eps, scale = self.num_heads, self.num_kv_heads, self.eps, self.scale
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            # The parameters' dict, not nn.Module's attribute lookup: ten a
            # layer at every step.
            p = layer._parameters
            weights = [p["qkv"], p["o"], p["post_norm"], p["gate_up"], p["down"]]
            biases = [p.get("qkv_bias"), p.get("o_bias"), p.get("gate_up_bias"),
                      p.get("down_bias")]
            nxt = layers[i + 1]._parameters["input_norm"] if i < last else None
            x, h = op(x, h, weights, biases, nxt, kv_cache.key(i), kv_cache.value(i), step,
                      cos, sin, heads, kv_heads, eps, scale, *last_args)
            self.safepoint(i)
        return x

    def _add_norm(self, x: torch.Tensor, r: torch.Tensor,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, its norm)."""
        if self.add_norm_fn is not None:
            return self.add_norm_fn(x, r, weight, self.eps)
        x = x + r
        return x, self.norm_fn(x, weight, self.eps)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, from one GEMM's output of both."""
        if (self._silu and gate_up.device.type == "cpu"
                and attention_cpp.silu_mul_vectorized(gate_up.dtype)):
            return torch.ops.preempt_serve.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def _rotation(
        self, positions: torch.Tensor
    ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The step's rotation of (q, k) at `positions`."""
        cos_table, sin_table = self.rotary.cos, self.rotary.sin
        if self.fused:
            from engine.models.fused_triton import apply_rotary_qk

            return lambda q, k: apply_rotary_qk(q, k, cos_table, sin_table, positions)
        if positions.device.type == "cpu" and attention_cpp.loaded():
            # One C++ operator (engine/csrc/norm_rotary.cpp), the same values.
            rotary_qk = torch.ops.preempt_serve.rotary_qk
            return lambda q, k: rotary_qk(q, k, cos_table, sin_table, positions)
        cos, sin = self.rotary.cos_sin(positions)
        return lambda q, k: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))

    def head_weight(self) -> torch.Tensor | None:
        return self.embed if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.vocab_logits(hidden, self.head_weight())
