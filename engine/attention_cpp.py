"""Paged decode and prefill attention as C++ operators built for this
machine's CPU.

The kernel (`engine/csrc/paged_decode.cpp`) attends each decode's single query token over
its cache blocks in place: no gather into a padded copy, no mask, and a software prefetch of
the next block, which lies at an unpredictable place in a cache far larger than the CPU's. A
build for an AVX512 capability takes float32 and bfloat16 caches through explicit vectors in
three passes per sequence (scores of 16 tokens at a time, the softmax over the whole
context, the weighted sum with each value row read once for up to four heads of its group);
an AVX2 build takes float32 caches through the portable loop's walk with its scores and
weighted sums in 8-lane vectors (`paged_decode_avx2.h`); other builds and dtypes take that
portable loop with an online softmax, which alone on one AVX2 core attends a served batch
1.8–1.9× faster than the Inductor-generated kernel (`engine.attention_compiled`,
`studies/engine_cpu/README.md`).

The operators' library is built and loaded by `engine/cpp_ops.py` (its
flags, the AMX and bf16 dot product builds, the fallback where no build
succeeds).

Where bf16 decodes take the AMX tiles and prefills the C++ prefill
operator, the backend keeps its cache in the tiles layout
(`engine/kv_layout.py`, `kv_layout`): the K/V write stores each token's
rows where the tiles read them (`write_kv_tiles`), decodes load every tile
as one run of memory (`paged_decode_tiles`), and a prefill chunk's context
blocks are read by the prefill operator as they lie (a key's pieces; a
pair of keys' values as words to transpose for the tiles, or a value picked
out of its pair as it is widened on the vectors).
PREEMPT_SERVE_KV_LAYOUT=rows keeps rows; `tiles` fails at start where the
tiles cannot be used.

Prefill chunks (`engine/csrc/paged_prefill.cpp`) go through one operator
call per step on a build for an AVX512 or an AVX2 capability (the AVX2 one
on 8-lane vectors), where `prefill_vectorized` allows: tiles of up to 64
query rows (a KV head's query heads for consecutive tokens) held
transposed, so that scores come out as vectors of 16 rows per key and the
online softmax needs no horizontal reduction; keys and values read from the
cache through the block table, so a later chunk of a chunked prompt or a
recompute needs no gather and no mask.  On one AVX512 core it attends a
512-token SmolLM2 prompt 3.6–3.8× faster than SDPA
(`studies/engine_cpu/prefill_op.py`).  Other builds keep prefills on SDPA.
Deterministic mode picks each position's operator by whether it is a
prompt position (`CppAttentionBackend`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

import torch

from engine.attention import AttentionMetadata, SeqSpan
from engine.cpp_build import amx_wanted, bf16_dot_wanted
from engine.cpp_ops import decode_amx, load_kernel, loaded, silu_mul_vectorized, vectorized
from engine.device_lists import on_device
from engine.kv_layout import pick_layout
from engine.attention_torch import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    _PrefillSpan,
)

log = logging.getLogger(__name__)

# The backend, and the operators' library (engine/cpp_ops.py) as the engine
# reaches it through this module.
__all__ = ["PREFILL_HEAD_DIMS", "CppAttentionBackend", "CppAttentionMetadata", "amx_wanted",
           "bf16_dot_wanted", "decode_amx", "load_kernel", "loaded", "prefill_vectorized",
           "silu_mul_vectorized", "vectorized"]

# Head dims the prefill operator's AVX512 path is built for.
PREFILL_HEAD_DIMS = (32, 64, 96, 128, 256)


def prefill_vectorized(head_dim: int, group: int) -> bool:
    """Whether prefill chunks go through the C++ prefill operator: on a
    build for an AVX512 or an AVX2 capability (engine/csrc/paged_prefill.cpp,
    paged_prefill_avx512.h, paged_prefill_avx2.h), with a head dim its vector path is built for and
    at most 64 query heads per KV head (float32 and bfloat16 take that path;
    float16 its portable loop).  Elsewhere the portable loop would be slower
    than SDPA's tiled matmuls, so prefills stay on SDPA."""
    return (torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")
            and head_dim in PREFILL_HEAD_DIMS and group <= 64)


def _token_rows(t: torch.Tensor) -> bool:
    """Whether each token's rows of `t` [T, kv_heads, dim] lie together."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


@dataclass(slots=True)
class CppAttentionMetadata(TorchAttentionMetadata):
    # Every decode's blocks, one table after another; None where decodes
    # take the reference path.
    decode_block_ids: torch.Tensor | None = None
    # [num_decodes] where each decode's table starts in decode_block_ids.
    decode_table_starts: torch.Tensor | None = None
    # [num_decodes] context length, the new token included.
    decode_context_lens: torch.Tensor | None = None
    # The step's prefill chunks for the prefill operator (None where they
    # take SDPA): every chunk's blocks, one table after another; where each
    # table starts; where each chunk's tokens start among the prefill tokens
    # (one more entry: their count); each chunk's first position.
    prefill_block_ids: torch.Tensor | None = None
    prefill_table_starts: torch.Tensor | None = None
    prefill_query_starts: torch.Tensor | None = None
    prefill_start_positions: torch.Tensor | None = None
    # Deterministic mode with prompt positions in the step: which of the
    # step's tokens each operator attends (None: decodes first, then
    # prefills, as in the reference backend).
    prefill_rows: torch.Tensor | None = None
    decode_rows: torch.Tensor | None = None
    # The step's tokens are all prompt positions: the prefill operator's output is the answer.
    prompt_rows_only: bool = False


class CppAttentionBackend(TorchAttentionBackend):
    """The reference backend with decodes, and prefills on an AVX512 or AVX2
    build, attended by the C++ operators.

    Deterministic mode gives every position one operator for good.  A prompt
    position (below its span's `prompt_len`) always lies in a prefill chunk,
    however the prompt is cut or recomputed: it goes through the prefill
    operator, whose result for a query row does not depend on its tile or
    chunk (engine/csrc/paged_prefill.cpp).  Every later position was decoded
    first and may be recomputed inside a prefill chunk after a preemption:
    it goes through the decode operator as a query over its sequence's blocks
    with context p + 1, the same code over the same keys in the same order
    as when it was decoded.  So a position's result cannot depend on how the
    work was cut or on what else is in the step.  Without the prefill
    operator, or without a prompt length, every position takes the decode
    operator (each query walks its context alone: slower prefill).
    """

    name = "cpp"
    metadata_cls = CppAttentionMetadata
    batch_invariant = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernel: Callable[..., torch.Tensor] | None = None
        self.prefill_kernel: Callable[..., torch.Tensor] | None = None
        if self.device.type != "cpu":
            raise ValueError("attention backend 'cpp' runs on CPU only")
        try:
            # At construction, so that the engine's start pays the build,
            # not its first request.
            self.kernel = load_kernel()
        except RuntimeError as e:
            if self.deterministic:
                # The reference path is not batch-invariant: no silent fallback.
                raise RuntimeError(
                    f"deterministic mode needs the C++ paged attention operator, which "
                    f"could not be built here ({e})") from e
            log.warning("C++ paged attention unavailable (%s); using the torch reference "
                        "attention", e)
        if self.kernel is not None and prefill_vectorized(self.head_dim,
                                                          self.num_heads // self.num_kv_heads):
            self.prefill_kernel = torch.ops.preempt_serve.paged_prefill
        self.kv_layout = pick_layout(
            self.kernel is not None and self.prefill_kernel is not None
            and self.dtype == torch.bfloat16 and torch.ops.preempt_serve.tiles_decodable(
                self.num_heads // self.num_kv_heads, self.block_size, self.head_dim))
        self.decode_kernel = (torch.ops.preempt_serve.paged_decode_tiles
                              if self.kv_layout == "tiles" else self.kernel)

    def build_metadata(self, spans: Sequence[SeqSpan]) -> TorchAttentionMetadata:
        if not self.deterministic or self._outputs_only(spans):
            # Decodes of outputs take the decode operator either way.
            return super().build_metadata(spans)
        bs = self.block_size
        slots: list[int] = []
        flat: list[int] = []
        starts: list[int] = []
        contexts: list[int] = []
        decode_rows: list[int] = []
        prompt_rows: list[int] = []
        prompt_spans: list[SeqSpan] = []
        seen_prefill = False
        token = 0
        for span in spans:
            ctx = span.context_len
            n_blocks = -(-ctx // bs)
            table = span.block_table
            if len(table) < n_blocks:
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold {ctx} tokens "
                    f"(block_size {bs})"
                )
            if span.num_tokens == 1 and seen_prefill:
                raise ValueError("single-token spans must precede multi-token spans")
            seen_prefill |= span.num_tokens > 1
            for pos in range(span.start_pos, ctx):
                slots.append(table[pos // bs] * bs + pos % bs)
            # Prompt positions go through the prefill operator, whose result
            # for a position does not depend on how its prompt was cut; every
            # later position through the decode operator, which decoded it
            # first and computes it again the same way after a recompute.
            prompt_end = span.start_pos
            if self.prefill_kernel is not None and span.prompt_len is not None:
                prompt_end = max(span.start_pos, min(span.prompt_len, ctx))
            if prompt_end > span.start_pos:
                n = prompt_end - span.start_pos
                prompt_rows.extend(range(token, token + n))
                prompt_spans.append(SeqSpan(span.start_pos, n, table))
            base = len(flat)
            if prompt_end < ctx:
                flat.extend(table[:n_blocks])
            for pos in range(prompt_end, ctx):
                decode_rows.append(token + pos - span.start_pos)
                starts.append(base)
                contexts.append(pos + 1)
            token += span.num_tokens
        dev = self.device
        fields: dict[str, Any] = {}
        if prompt_spans:
            fields = self._prefill_fields(prompt_spans)
            fields["prefill_rows"] = on_device(prompt_rows, torch.long, dev)
            fields["decode_rows"] = on_device(decode_rows, torch.long, dev)
            fields["prompt_rows_only"] = len(prompt_rows) == token
        return CppAttentionMetadata(
            slot_mapping=on_device(slots, torch.long, dev),
            num_decodes=len(decode_rows),
            prefills=[],
            decode_block_ids=on_device(flat, torch.long, dev),
            decode_table_starts=on_device(starts, torch.long, dev),
            decode_context_lens=on_device(contexts, torch.long, dev),
            **fields,
        )

    def _outputs_only(self, spans: Sequence[SeqSpan]) -> bool:
        """Whether every span is one token past its prompt (a decode step's
        usual plan), which deterministic mode attends as the default does."""
        if self.prefill_kernel is None:
            return all(s.num_tokens == 1 for s in spans)
        return all(s.num_tokens == 1 and (s.prompt_len is None or s.prompt_len <= s.start_pos)
                   for s in spans)

    def decode_layer_step(
        self, metadata: AttentionMetadata, num_tokens: int
    ) -> tuple[list[torch.Tensor], bool] | None:
        md = metadata
        # The cases in which `forward` writes with write_kv(_tiles) and
        # answers with the decode operator alone (`_write_kv`, `_attend`).
        if (not isinstance(md, CppAttentionMetadata) or not self._decodes_only(md, num_tokens)
                or md.decode_table_starts is None or md.decode_context_lens is None
                or num_tokens == 0):
            return None
        return ([md.slot_mapping, md.decode_block_ids, md.decode_table_starts,
                 md.decode_context_lens], self.kv_layout == "tiles")

    def prefill_layer_step(
        self, metadata: AttentionMetadata, num_tokens: int
    ) -> tuple[list[torch.Tensor | None], int, bool] | None:
        md = metadata
        # The cases in which `_attend` answers the prompt rows with the
        # prefill operator and any other rows with the decode operator.
        if (not isinstance(md, CppAttentionMetadata) or num_tokens == 0
                or self.kernel is None or self.prefill_kernel is None
                or md.prefill_block_ids is None):
            return None
        nd = md.num_decodes
        rows: list[torch.Tensor | None] = [None, None]
        if md.prefill_rows is not None:
            # Deterministic mode: each position to its operator.
            if not md.prompt_rows_only:
                rows = [md.prefill_rows, md.decode_rows]
        elif nd + sum(p.token_end - p.token_start for p in md.prefills) != num_tokens:
            return None
        if (nd or rows[0] is not None) and md.decode_block_ids is None:
            return None
        return ([md.slot_mapping, md.prefill_block_ids, md.prefill_table_starts,
                 md.prefill_query_starts, md.prefill_start_positions, md.decode_block_ids,
                 md.decode_table_starts, md.decode_context_lens, *rows], nd,
                self.kv_layout == "tiles")

    def _decodes_only(self, md: CppAttentionMetadata, num_tokens: int) -> bool:
        """Whether the step's `num_tokens` rows are all decodes that the decode
        operator answers alone (no prompt positions beside them)."""
        return (self.kernel is not None and md.prefill_rows is None and not md.prefills
                and md.decode_block_ids is not None and md.num_decodes == num_tokens)

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, md: TorchAttentionMetadata) -> None:
        if self.kv_layout == "tiles":
            torch.ops.preempt_serve.write_kv_tiles(k.contiguous(), v.contiguous(), key_cache,
                                                   value_cache, md.slot_mapping)
            return
        if self.kernel is None or not (_token_rows(k) and _token_rows(v)
                                       and key_cache.is_contiguous()
                                       and value_cache.is_contiguous()):
            super()._write_kv(k, v, key_cache, value_cache, md)
            return
        # A copy per token (engine/csrc/kv_write.cpp).
        torch.ops.preempt_serve.write_kv(k, v, key_cache, value_cache, md.slot_mapping)

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
        assert isinstance(md, CppAttentionMetadata)
        if md.prefill_rows is None:
            # Decodes only, or prefill chunks only: one operator's output is the
            # whole answer (no copy).
            if self._decodes_only(md, q.shape[0]):
                return self._decode(q, key_cache, value_cache, md, scale)
            if (md.num_decodes == 0 and self.prefill_kernel is not None
                    and md.prefill_block_ids is not None):
                return self._prefill_op(q, key_cache, value_cache, md, scale)
            return super()._attend(q, k, v, key_cache, value_cache, md, scale)
        # Deterministic mode with prompt positions: each position to its
        # operator (build_metadata), the rows gathered and put back.
        assert self.kernel is not None and self.prefill_kernel is not None
        if md.prompt_rows_only:  # no gather and scatter of every row
            return self._prefill_op(q, key_cache, value_cache, md, scale)
        out = torch.empty_like(q)
        out.index_copy_(0, md.prefill_rows, self._prefill_op(
            q.index_select(0, md.prefill_rows), key_cache, value_cache, md, scale))
        if md.num_decodes:
            assert md.decode_rows is not None
            out.index_copy_(0, md.decode_rows, self.decode_kernel(
                q.index_select(0, md.decode_rows), key_cache, value_cache,
                md.decode_block_ids, md.decode_table_starts, md.decode_context_lens, scale))
        return out

    def _prefill_span(self, span: SeqSpan, token: int) -> _PrefillSpan:
        if self.prefill_kernel is None:
            return super()._prefill_span(span, token)
        # The operator reads the chunk's keys from the cache: no mask, no gather.
        return _PrefillSpan(token, token + span.num_tokens, span.start_pos, span.context_len,
                            None, None)

    def _prefill_fields(self, spans: list[SeqSpan]) -> dict[str, Any]:
        if self.prefill_kernel is None:
            return {}
        bs = self.block_size
        tables = [s.block_table[: -(-s.context_len // bs)] for s in spans]
        dev = self.device
        return {
            "prefill_block_ids": on_device(list(chain.from_iterable(tables)), torch.long, dev),
            "prefill_table_starts": on_device(
                [0, *accumulate(len(t) for t in tables)][:-1], torch.long, dev),
            "prefill_query_starts": on_device(
                [0, *accumulate(s.num_tokens for s in spans)], torch.long, dev),
            "prefill_start_positions": on_device([s.start_pos for s in spans], torch.long, dev),
        }

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
        assert isinstance(md, CppAttentionMetadata)
        if self.prefill_kernel is None or md.prefill_block_ids is None:
            super()._prefill(q, k, v, key_cache, value_cache, md, scale, out)
            return
        # Prefill tokens follow the decodes, chunk after chunk.
        out[md.num_decodes:] = self._prefill_op(q[md.num_decodes:], key_cache, value_cache, md,
                                                scale)

    def _prefill_op(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    md: CppAttentionMetadata, scale: float) -> torch.Tensor:
        assert self.prefill_kernel is not None and md.prefill_block_ids is not None
        return self.prefill_kernel(q, key_cache, value_cache, md.prefill_block_ids,
                                   md.prefill_table_starts, md.prefill_query_starts,
                                   md.prefill_start_positions, scale, self.kv_layout == "tiles")

    def _decode_fields(
        self, tables: list[Sequence[int]], contexts: list[int]
    ) -> dict[str, Any]:
        if self.kernel is None:
            return super()._decode_fields(tables, contexts)
        flat = list(chain.from_iterable(tables))
        starts = [0, *accumulate(len(t) for t in tables)][:-1]
        dev = self.device
        return {
            "decode_block_ids": on_device(flat, torch.long, dev),
            "decode_table_starts": on_device(starts, torch.long, dev),
            "decode_context_lens": on_device(contexts, torch.long, dev),
        }

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(md, CppAttentionMetadata)
        if self.decode_kernel is None or md.decode_block_ids is None:
            return super()._decode(q, key_cache, value_cache, md, scale)
        return self.decode_kernel(q, key_cache, value_cache, md.decode_block_ids,
                           md.decode_table_starts, md.decode_context_lens, scale)
