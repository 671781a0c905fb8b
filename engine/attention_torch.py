"""Torch reference attention over the paged KV cache (CPU, or any device).

Decodes (single-token chunks) are attended together in one batched
`scaled_dot_product_attention`: their blocks are gathered into a
`[batch, max_context, kv_heads, head_dim]` tensor padded to the longest
context, and a boolean mask hides the padding.  The query heads that share a
KV head ride as that head's "query rows" (`[batch, kv_heads, group, dim]`),
so grouped-query attention needs no K/V repetition.  A Python loop per
decode would cost ~30 small kernels × layers × batch per step.

Prefill chunks are attended one by one (each is already a large matmul).
A chunk starting at position 0 attends to its own fresh K/V with a causal
mask, without reading the cache back; a later chunk (chunked prefill, or a
recompute after preemption) gathers its earlier tokens from the cache and
uses an explicit mask, because SDPA's `is_causal` aligns the triangle to the
top left when there are more keys than queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata, SeqSpan
from engine.device_lists import on_device


@dataclass(slots=True)
class _PrefillSpan:
    token_start: int
    token_end: int
    start_pos: int
    context_len: int
    # Blocks covering the context; only read when start_pos > 0.
    block_ids: torch.Tensor | None
    # [num_tokens, context_len] bool, True where a key may be attended.
    mask: torch.Tensor | None


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    # Flat cache row (block * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    num_decodes: int
    prefills: list[_PrefillSpan]
    # The padded decode tensors `_decode` reads (`_decode_fields`); left
    # None by a subclass whose decode path does not read them.
    # [num_decodes, max_blocks] block ids, padded with block 0 (masked).
    decode_block_tables: torch.Tensor | None = None
    # [num_decodes, 1, 1, decode_max_context] bool; None when no decode
    # needs padding.
    decode_mask: torch.Tensor | None = None
    decode_max_context: int = 0


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    metadata_cls: ClassVar[type[TorchAttentionMetadata]] = TorchAttentionMetadata

    def build_metadata(self, spans: Sequence[SeqSpan]) -> TorchAttentionMetadata:
        bs = self.block_size
        slots: list[int] = []
        num_decodes = 0
        decode_tables: list[Sequence[int]] = []
        decode_ctx: list[int] = []
        prefills: list[_PrefillSpan] = []
        prefill_spans: list[SeqSpan] = []
        token = 0
        for span in spans:
            n = span.num_tokens
            ctx = span.context_len
            table = span.block_table
            if len(table) * bs < ctx:
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold {ctx} tokens "
                    f"(block_size {bs})"
                )
            if n == 1:
                if prefills:
                    raise ValueError("single-token spans must precede multi-token spans")
                pos = ctx - 1
                slots.append(table[pos // bs] * bs + pos % bs)
                num_decodes += 1
                decode_tables.append(table[: -(-ctx // bs)])
                decode_ctx.append(ctx)
            else:
                for pos in range(span.start_pos, ctx):
                    slots.append(table[pos // bs] * bs + pos % bs)
                prefills.append(self._prefill_span(span, token))
                prefill_spans.append(span)
            token += n

        return self.metadata_cls(
            slot_mapping=on_device(slots, torch.long, self.device),
            num_decodes=num_decodes,
            prefills=prefills,
            **(self._decode_fields(decode_tables, decode_ctx) if num_decodes else {}),
            **(self._prefill_fields(prefill_spans) if prefill_spans else {}),
        )

    def _prefill_span(self, span: SeqSpan, token: int) -> _PrefillSpan:
        """A prefill chunk's entry, with the mask and blocks SDPA needs for
        a chunk that starts past position 0."""
        ctx = span.context_len
        block_ids = mask = None
        if span.start_pos > 0:
            block_ids = torch.tensor(
                span.block_table[: -(-ctx // self.block_size)], dtype=torch.long,
                device=self.device,
            )
            q_pos = torch.arange(span.start_pos, ctx, device=self.device)
            k_pos = torch.arange(ctx, device=self.device)
            mask = k_pos[None, :] <= q_pos[:, None]
        return _PrefillSpan(token, token + span.num_tokens, span.start_pos, ctx, block_ids, mask)

    def _prefill_fields(self, spans: list[SeqSpan]) -> dict[str, Any]:
        """Extra metadata for the step's prefill chunks (a subclass's own
        prefill path); none here."""
        return {}

    def _decode_fields(
        self, tables: list[Sequence[int]], contexts: list[int]
    ) -> dict[str, Any]:
        """The decode part of the step's metadata, from each decode's blocks
        (cut to its context) and context length."""
        max_ctx = max(contexts)
        max_blocks = -(-max_ctx // self.block_size)
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in tables]
        mask = None
        if min(contexts) < max_ctx:  # no padding, no mask: a faster kernel path
            ctx_t = torch.tensor(contexts, device=self.device)
            mask = (torch.arange(max_ctx, device=self.device)[None, :] < ctx_t[:, None]
                    ).view(len(contexts), 1, 1, max_ctx)
        return {
            "decode_block_tables": torch.tensor(padded, dtype=torch.long, device=self.device),
            "decode_mask": mask,
            "decode_max_context": max_ctx,
        }

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
        assert isinstance(metadata, TorchAttentionMetadata)
        self._write_kv(k, v, key_cache, value_cache, metadata)
        return self._attend(q, k, v, key_cache, value_cache, metadata, scale)

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, md: TorchAttentionMetadata) -> None:
        """The step's new K/V into the cache, at `md.slot_mapping`."""
        kvh, hd = self.num_kv_heads, self.head_dim
        key_cache.view(-1, kvh, hd).index_copy_(0, md.slot_mapping, k)
        value_cache.view(-1, kvh, hd).index_copy_(0, md.slot_mapping, v)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of the step's tokens, their K/V already in the cache:
        the decodes (the first `num_decodes` tokens), then the prefills."""
        out = torch.empty_like(q)
        nd = md.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], key_cache, value_cache, md, scale)

        if md.prefills:
            self._prefill(q, k, v, key_cache, value_cache, md, scale, out)
        return out

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: TorchAttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of the step's prefill chunks, written into `out`."""
        kvh, hd = self.num_kv_heads, self.head_dim
        group = self.num_heads // kvh
        for p in md.prefills:
            qs = q[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)
            if p.block_ids is None:
                ks = k[p.token_start : p.token_end]
                vs = v[p.token_start : p.token_end]
            else:
                ks = key_cache.index_select(0, p.block_ids).view(-1, kvh, hd)[: p.context_len]
                vs = value_cache.index_select(0, p.block_ids).view(-1, kvh, hd)[: p.context_len]
            ks = ks.transpose(0, 1).unsqueeze(0)
            vs = vs.transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qs,
                ks,
                vs,
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=scale,
                enable_gqa=group > 1,
            )
            out[p.token_start : p.token_end] = op[0].transpose(0, 1)

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of the step's single-token chunks: q `[nd, heads, dim]`."""
        nd = md.num_decodes
        kvh, hd = self.num_kv_heads, self.head_dim
        tables = md.decode_block_tables
        assert tables is not None
        ctx = md.decode_max_context
        flat = tables.view(-1)
        # index_select, not key_cache[tables]: advanced indexing is ~9×
        # slower on CPU for this gather.
        kd = key_cache.index_select(0, flat).view(nd, -1, kvh, hd)[:, :ctx].transpose(1, 2)
        vd = value_cache.index_select(0, flat).view(nd, -1, kvh, hd)[:, :ctx].transpose(1, 2)
        qd = q.view(nd, kvh, self.num_heads // kvh, hd)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=md.decode_mask, scale=scale)
        return od.reshape(nd, self.num_heads, hd)
