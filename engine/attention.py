"""The attention seam: what every attention backend is given and must do.

A step's batch is flattened: the tokens of all scheduled chunks laid end to
end, single-token chunks (decodes) first, then multi-token chunks (prefill
and recompute).  Each chunk computes positions `[start_pos, start_pos + n)`
of its sequence and attends causally to all of the sequence's cached tokens
`0 .. start_pos + n`.  A backend (1) writes the chunk's new K/V into the paged
cache slots its block table names and (2) attends over the cache.

The torch reference backend (`engine.attention_torch`) runs anywhere; the
compiled backend (`engine.attention_compiled`) fuses its decode attention
into one Inductor-generated loop over the block table; the C++ backend
(`engine.attention_cpp`, the CPU default) attends decodes in place over the
blocks, and prefill chunks too on an AVX512 or AVX2 build; the Triton
backend (`engine.attention_triton`, the CUDA default) attends decodes and
prefill chunks over the paged cache in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.kv_layout import KVLayout


@dataclass(slots=True)
class SeqSpan:
    """One chunk of the flattened batch, in batch order.  Not frozen: a
    frozen dataclass sets each field through `object.__setattr__`, 3x the
    constructor's time, and one is built per chunk of every step."""

    start_pos: int
    num_tokens: int
    # Device block ids covering at least start_pos + num_tokens tokens.
    block_table: Sequence[int]
    # The sequence's prompt length, where known: positions below it are
    # prompt tokens, always computed in prefill chunks (however the prompt
    # is cut), those from it on were each decoded first.  Deterministic
    # mode on CPU picks each position's attention operator by it.
    prompt_len: int | None = None

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens


class AttentionMetadata:
    """Backend-specific tensors describing one step; built once, read per layer."""


class AttentionBackend(ABC):
    name: ClassVar[str]
    # Whether the backend can attend every query token, prefill or decode,
    # with one fixed order of reductions over its own context, so that the
    # result does not depend on the step's other tokens (deterministic mode).
    batch_invariant: ClassVar[bool] = False
    # How this backend's cache orders each block's bytes (engine/kv_layout.py);
    # only the C++ backend ever picks `tiles`.
    kv_layout: KVLayout = "rows"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        device: torch.device,
        deterministic: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        if deterministic and not self.batch_invariant:
            raise ValueError(
                f"attention backend {self.name!r} is not batch-invariant; deterministic "
                "mode needs 'cpp' on CPU or 'triton' on CUDA"
            )
        self.deterministic = deterministic
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.device = device
        # The cache's dtype, where the caller knows it (a layout may depend on it).
        self.dtype = dtype

    @abstractmethod
    def build_metadata(self, spans: Sequence[SeqSpan]) -> AttentionMetadata:
        """Describe a step whose spans are in batch order, decodes first."""

    def decode_layer_step(
        self, metadata: AttentionMetadata, num_tokens: int
    ) -> tuple[list[torch.Tensor], bool] | None:
        """Where a step of `num_tokens` tokens is decodes only and this
        backend attends them with the C++ decode operator: that operator's
        tensors `[slots, block_ids, table_starts, context_lens]` and whether
        the cache is in `tiles`, for the one-operator decoder layer
        (engine/csrc/decode_layer.cpp).  None: the layer runs op by op."""
        return None

    def prefill_layer_step(
        self, metadata: AttentionMetadata, num_tokens: int
    ) -> tuple[list[torch.Tensor | None], int, bool] | None:
        """Where a step of `num_tokens` tokens has prompt chunks that this
        backend attends with the C++ prefill operator (and its decodes, if
        any, with the decode operator): the `prefill_layer_*` operator's step
        entries before the positions (engine/csrc/decode_layer.cpp,
        `PrefillStep`), the number of decodes and whether the cache is in
        `tiles`.  None: the layer runs op by op."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store k/v, then attend.

        q: `[T, num_heads, head_dim]`; k, v: `[T, num_kv_heads, head_dim]`;
        caches: `[num_blocks, block_size, num_kv_heads, head_dim]` (one layer).
        Returns `[T, num_heads, head_dim]`.  Query head h reads KV head
        `h // (num_heads // num_kv_heads)` (grouped-query attention).
        """


def get_attention_backend(name: str) -> type[AttentionBackend]:
    # Imported here so that a GPU backend's Triton import never happens on
    # a machine that does not select it.
    from engine.attention_compiled import CompiledAttentionBackend
    from engine.attention_cpp import CppAttentionBackend
    from engine.attention_torch import TorchAttentionBackend

    backends: dict[str, type[AttentionBackend]] = {
        TorchAttentionBackend.name: TorchAttentionBackend,
        CompiledAttentionBackend.name: CompiledAttentionBackend,
        CppAttentionBackend.name: CppAttentionBackend,
    }
    if name == "triton":
        from engine.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend
    try:
        return backends[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of "
            f"{sorted([*backends, 'triton'])}"
        ) from None


def default_backend_name(device: torch.device) -> str:
    return "cpp" if device.type == "cpu" else "triton"
