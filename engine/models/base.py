"""What the runner needs from a model: a forward pass over a flattened batch.

Each model file owns its forward pass (ours, not `transformers`': the engine
must read K/V from the paged cache) and the mapping from Hugging Face
checkpoint names to its parameters.  Parameters are frozen tensors; the
engine only runs inference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.kv_cache import KVCache
from engine.models import packed_bf16, packed_f32, prepacked, weight_codes
from engine.models.batch_invariant import TILE_ROWS, TiledLinear
from engine.models.linear import LinearFn, linear_for
from engine.preemption import PreemptFlag
from engine.pipeline_parallel import SINGLE_STAGE, PipelineStage
from engine.tensor_parallel import SINGLE, TensorParallel, load_slice

# Our CPU GEMMs, in the order `auto` considers them: `pack_projections`'
# name, the module that packs and multiplies, the dtype it takes, and what
# the CPU needs (for the start-up error).
_OUR_KERNELS: tuple[tuple[Literal["bf16_dot", "f32_fma"], Any, torch.dtype, str], ...] = (
    ("bf16_dot", packed_bf16, torch.bfloat16, "avx512_bf16"),
    ("f32_fma", packed_f32, torch.float32, "avx2 and fma"),
)


@dataclass(slots=True)
class ForwardBatch:
    """One step's flattened tokens (decodes first, then prefill chunks)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, position of each token in its sequence
    attn_metadata: AttentionMetadata
    # Rows of the batch whose next-token logits are wanted (last token of
    # each sampling chunk, then prompt positions whose logprobs are asked
    # for); the final norm and lm_head run on these only.
    logits_indices: torch.Tensor  # [S] long
    # The pass's LoRA adapters and their rows (engine/lora.py `LoraStep`);
    # None: every row runs the base model.
    lora: Any = None


@dataclass(slots=True, frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, or a row slice of one."""

    param: str
    # For fused parameters (q|k|v): index of the shard, whose row
    # sizes the model lists in `fused_shards`.
    shard: int | None = None


class WeightLoadError(ValueError):
    pass


def frozen(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def fixed_tiles(linear: LinearFn, device: torch.device, rows: int = TILE_ROWS,
                weights: Sequence[torch.Tensor] = ()) -> LinearFn:
    """`linear` made batch-invariant (`CausalLM.use_fixed_tiles`); on CUDA
    large batches by `weights` may take a larger tile that rounds the same
    (`engine.models.matmul_triton.InvariantLinear`)."""
    if device.type == "cuda":
        from engine.models.matmul_triton import InvariantLinear, invariant_linear

        return InvariantLinear(weights) if weights else invariant_linear
    return TiledLinear(linear, rows)


class CausalLM(nn.Module, ABC):
    model_type: ClassVar[str]

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    # Parameters every layer multiplies through `self.linear` (the lm_head is
    # not one: it has `head_linear`); `pack_projections` packs these.
    projection_names: ClassVar[tuple[str, ...]] = ()
    # Tensor parallelism (engine/tensor_parallel.py): the dimension along
    # which each shard holds a slice of a parameter, by its last name;
    # parameters not listed are whole on every shard.
    tp_split: ClassVar[dict[str, int]] = {}
    # Of those, the ones split by vocabulary rows (the last slice padded).
    tp_vocab: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, pp: PipelineStage = SINGLE_STAGE) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.tp = tp
        # With pipeline parallelism this model holds one stage's layers
        # (`num_layers` of them, from `layer_range.start`), the embedding on
        # the first stage, the final norm and the head on the last.
        self.pp = pp
        self.layer_range = pp.layers(config.num_hidden_layers)
        self.num_layers = len(self.layer_range)
        # For which kernel `pack_projections` packed the projections' weights:
        # "onednn" (engine.models.prepacked), "bf16_dot"
        # (engine.models.packed_bf16), "f32_fma" (engine.models.packed_f32)
        # or "none".
        self.packing = "none"
        # Every projection goes through this (see engine.models.linear).
        self.linear: LinearFn = linear_for(dtype, device)
        # The lm_head's matmul (see engine.models.prepacked).
        self.head_linear: LinearFn = (
            prepacked.PrepackedLinear() if prepacked.available(dtype, device) else self.linear)
        # Backend chosen by the runner (`set_attention_backend`) before use.
        self.attn: AttentionBackend | None = None
        # The projections' and the head's GGUF codes by parameter name, from
        # `load_weights` for `pack_projections` (which empties it).
        self.source_codes: dict[str, torch.Tensor] = {}
        # Armed by the runner for a pass that may be cut between layers
        # (engine/preemption.py); checked at the end of each layer.
        self.preempt: PreemptFlag | None = None

    @property
    def packed(self) -> bool:
        """Whether `pack_projections` packed the projections' weights."""
        return self.packing != "none"

    def pack_projections(self, mode: prepacked.PackMode, codes: bool = True) -> float | None:
        """Multiply every projection on a packed weight where that pays, on
        CPU: bfloat16 on our VDPBF16PS kernel where `auto` prefers it
        (engine.models.packed_bf16) or `bf16_dot` asks for it, float32 on our
        AVX2 FMA kernel where `auto` prefers it (engine.models.packed_f32) or
        `f32_fma` asks for it (a weight decoded from GGUF codes kept as them
        where `codes`: packed_f32.pack, and in bfloat16 where `load_weights`
        kept them: `codes_wanted`); otherwise on oneDNN's layout
        (engine.models.prepacked), float32 and natively multiplied bfloat16,
        `auto` timing both ways on the largest projection's shape first.
        Returns the measured speed-up (None where nothing was timed);
        `self.packing` says the choice."""
        source, self.source_codes = self.source_codes, {}
        for kernel, module, dtype, cpu_needs in _OUR_KERNELS:
            if mode == kernel or (mode == "auto" and module.preferred(self.dtype, self.device)):
                if not (self.device.type == "cpu" and self.dtype is dtype and module.built()):
                    name = str(dtype).removeprefix("torch.")
                    raise ValueError(
                        f"pack_projections '{kernel}' needs dtype {name} on a CPU "
                        f"with {cpu_needs} and the C++ operators built for it")
                if module is packed_f32:
                    packed_f32.pack_in_place(self, self.projection_names, codes)
                else:
                    packed_bf16.pack_in_place(self, self.projection_names,
                                              source if codes else None)
                self.linear = prepacked.packed_linear
                # The lm_head packed beside its plain weight (which a tied
                # embedding also reads), in bf16 with its codes where kept.
                head = self.head_weight()
                head_codes = {id(head): c for n, p in self.named_parameters()
                              if p is head and (c := source.get(n)) is not None} if codes else {}
                self.head_linear = prepacked.PrepackedLinear(kernel, codes, head_codes)
                self.packing = kernel
                return None
        if not prepacked.available(self.dtype, self.device) or mode == "never":
            return None
        speedup = None
        if mode == "auto":
            shapes = [tuple(w.shape) for n, w in self.named_parameters()
                      if n.rsplit(".", 1)[-1] in self.projection_names and w.dim() == 2]
            if not shapes:
                return None
            out_f, in_f = max(shapes, key=lambda s: s[0] * s[1])
            speedup = prepacked.packing_speedup(out_f, in_f, dtype=self.dtype)
        if prepacked.should_pack(mode, speedup):
            prepacked.pack_in_place(self, self.projection_names)
            self.linear = prepacked.packed_linear
            self.packing = "onednn"
        return speedup

    def weight_codes(self) -> dict[str, int]:
        """How many weights are multiplied from GGUF codes, by format
        (engine.models.packed_f32): the projections and, once it has been
        used, the lm_head."""
        tensors = list(self.parameters())
        head = getattr(self.head_linear, "inner", self.head_linear)  # under deterministic tiles
        if isinstance(head, prepacked.PrepackedLinear):
            tensors += head.packed_weights()
        return weight_codes.code_formats(tensors)

    def use_fixed_tiles(self, device: torch.device, rows: int = TILE_ROWS) -> None:
        """Run every projection and the lm_head so that a row's result does
        not depend on the rows beside it (deterministic mode): on CPU in
        fixed-shape row tiles of the library's GEMM
        (engine.models.batch_invariant), on CUDA through one Triton GEMM
        with a single tile configuration, and a larger tile for long prompts
        where it was checked here to round the same on this model's weights
        (engine.models.matmul_triton)."""
        weights = [w for n, w in self.named_parameters()
                   if n.rsplit(".", 1)[-1] in self.projection_names and w.dim() == 2]
        head = self.head_weight()
        self.linear = fixed_tiles(self.linear, device, rows, weights)
        self.head_linear = fixed_tiles(self.head_linear, device, rows,
                                       [] if head is None else [head])

    def safepoint(self, layer: int) -> None:
        if self.preempt is not None:
            self.preempt.check(layer)

    def project(self, lora: Any, layer: int, name: str, x: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor | None, row: bool = False) -> torch.Tensor:
        """Layer `layer`'s projection `name` of `x` (row-parallel where
        `row`), with the pass's LoRA deltas (`ForwardBatch.lora`) added."""
        y = self.row_linear(x, w, bias) if row else self.linear(x, w, bias)
        return y if lora is None else lora.add(layer, name, x, y)

    def row_linear(self, x: torch.Tensor, w: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel projection: this shard's partial product, summed
        over the shards, then the (whole) bias once."""
        if not self.tp.enabled:
            return self.linear(x, w, bias)
        y = self.tp.all_reduce(self.linear(x, w, None))
        return y if bias is None else y + bias

    def vocab_logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on the first shard (None on the
        others) from a vocab-parallel `head`: float32, but for an unsplit
        model on CPU, whose logits stay in the model's dtype (a bfloat16
        model's greedy argmax reads them as they are; a float32 copy of every
        row costs 5-6 ms of a batch-96 SmolLM2 step; the sampler widens them
        where it needs float32: `engine.sampling`)."""
        local = self.head_linear(hidden, head)
        if self.tp.enabled or self.pp.enabled or local.device.type != "cpu":
            local = local.float()
        return self.tp.gather_logits(local, self.vocab_size)

    def head_weight(self) -> torch.Tensor | None:
        """The lm_head's weight `[vocab rows, hidden]` (this shard's rows;
        None where this stage holds none)."""
        return None

    def exact_source(self, hidden: torch.Tensor,
                     logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What breaks the ties of `logits` (from `compute_logits(hidden)`)
        by their exact values (engine.logits_cpu): the hidden rows and the
        head's weight, where the logits stayed rounded to the model's dtype
        (an unsplit bfloat16 model on CPU, `vocab_logits`); None elsewhere."""
        head = self.head_weight()
        if logits is None or logits.dtype == torch.float32 or head is None \
                or self.tp.enabled or self.pp.enabled:
            return None
        return hidden, head[: logits.shape[1]]

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        self.attn = backend

    @abstractmethod
    def forward(self, batch: ForwardBatch, kv_cache: KVCache,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states `[S, hidden]` at `batch.logits_indices`; on a
        pipeline stage but the last, the hidden states of every row after
        its layers, from the previous stage's `hidden` (but on the first)."""

    def stage_layer(self, index: int) -> int | None:
        """This stage's index of the model's layer `index` (None: another
        stage's)."""
        if index in self.layer_range:
            return index - self.layer_range.start
        return None

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`[S, vocab]` logits (with tensor parallelism, on the first shard
        only; None on the others), in float32 but on an unsplit CPU model
        (`vocab_logits`)."""

    @abstractmethod
    def weight_target(self, hf_name: str) -> WeightTarget | None:
        """Our parameter for checkpoint tensor `hf_name`; None to skip it.

        Raises `WeightLoadError` for a name the model does not know, so that a
        renamed checkpoint fails loudly instead of leaving weights random.
        """

    def _shard_of(self, param: str, dest: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel shard's slice of checkpoint tensor `full`."""
        leaf = param.rsplit(".", 1)[-1]
        dim = self.tp_split.get(leaf)
        if not self.tp.enabled or dim is None or full.dim() <= dim:
            return full
        whole = dest.shape[dim] * self.tp.size
        vocab = leaf in self.tp_vocab
        if (full.shape[dim] > whole) if vocab else (full.shape[dim] != whole):
            return full  # the shape check names the mismatch
        return load_slice(dest, full, dim, self.tp)

    def fused_shards(self, param: str) -> list[int]:
        """Row sizes of the shards of a fused parameter (override if fused)."""
        raise WeightLoadError(f"{param} is not a fused parameter")

    def codes_wanted(self, mode: prepacked.PackMode) -> bool:
        """Whether `pack_projections(mode)` may keep this bf16 model's
        projections and head with their GGUF codes (engine.models.weight_codes),
        so that `load_weights` should fit them on the checkpoint's float32
        values: bf16 on our kernel where it multiplies on AMX tiles."""
        ours = mode == "bf16_dot" or (
            mode == "auto" and packed_bf16.preferred(self.dtype, self.device))
        return (ours and self.dtype is torch.bfloat16 and self.device.type == "cpu"
                and packed_bf16.codes_pay())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     keep_codes: bool = False) -> None:
        """Every parameter from the checkpoint's `weights`; where
        `keep_codes`, the GGUF codes of the projections' and the head's
        float32 tensors are kept in `source_codes` for `pack_projections`
        (`codes_wanted`)."""
        params = dict(self.named_parameters())
        head = self.head_weight()
        codes = weight_codes.SourceCodes(
            n for n, p in params.items()
            if n.rsplit(".", 1)[-1] in self.projection_names or p is head) if keep_codes else None
        loaded: set[str] = set()
        shard_seen: dict[str, set[int]] = {}
        for hf_name, tensor in weights:
            target = self.weight_target(hf_name)
            if target is None:
                continue
            param = params.get(target.param)
            if param is None:
                raise WeightLoadError(f"{hf_name} maps to unknown parameter {target.param}")
            dest = param.data
            if target.shard is not None:
                sizes = self.fused_shards(target.param)
                start = sum(sizes[: target.shard])
                dest = dest[start : start + sizes[target.shard]]
                shard_seen.setdefault(target.param, set()).add(target.shard)
            tensor = self._shard_of(target.param, dest, tensor)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightLoadError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} does not fit "
                    f"{target.param} slice of shape {tuple(dest.shape)}"
                )
            if codes is not None:
                codes.add(target.param, target.shard, tensor)
            dest.copy_(tensor)
            if target.shard is None:
                loaded.add(target.param)
        for name, shards in shard_seen.items():
            if len(shards) == len(self.fused_shards(name)):
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise WeightLoadError(f"checkpoint lacks weights for {missing}")
        if codes is not None:
            self.source_codes = codes.finish(lambda p: len(self.fused_shards(p)))
