"""Projection and head weights kept as the GGUF codes they were decoded from (CPU).

The embedded SmolLM2 ships as a GGUF file of Q4_1 blocks (its embedding
Q8_0), converted to float32 when it is first resolved
(`engine.model_source`): every 32 values along a row are m + d q exactly,
d and m float16, q a 4- or 8-bit code.  A decode step reads every weight
from memory, so keeping such a weight as its codes (6 or 9 bits a weight
with the scales, against 16 in bf16 and 32 in float32) is the cheapest way
to read it, as long as the product comes out the same.

- float32 (`engine.models.packed_f32`): the codes are fitted on the model's
  own weights when they are packed; the AVX2 kernel decodes each value
  exactly and sums the same FMA chains as on the float32 weight.
- bfloat16 (`engine.models.packed_bf16`, on AMX tiles): the model rounds
  every value when it loads, after which m + d q can no longer be found, so
  the loader fits the codes on the float32 values first (`SourceCodes`).
  `pack_projections` keeps a projection (and the lm_head, when it packs it)
  as its codes, beside its packed bf16 values (`with_values`), only where
  they decode (`engine/csrc/gemm_bf16_codes.cpp`: m + d q in float32,
  rounded to nearest even) to exactly the model's bf16 weight
  (`decodes_to`).  The kernel
  multiplies the codes at up to 64 rows (a decode step's batch) and the
  values beyond (prefills), the same bf16 operands in the same order either
  way, so the logits are bit for bit those of the bf16 weight and
  deterministic mode is as before.  The price is memory: the codes add
  3/8 (Q4) or 9/16 (Q8) to the weight's bf16 bytes.

Layout (`engine/csrc/gemm_f32_codes.cpp`): `[N/16, K/32, bytes]` uint8, one
block per 16 output columns and 32 of K, 384 bytes (Q4) or 576 (Q8): the
scales, then the codes; a bf16 model keeps the codes in another order
(`to_bf16_layout`), all of them followed by its packed bf16 values
(`with_values`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import torch

from engine import attention_cpp

# Bytes of one block of 16 columns x 32 k, by format: the codes alone
# (float32); the codes and the bf16 values (bfloat16: `with_values`'s
# buffer, shaped as if each block held both).
CODE_BLOCK_BYTES = {384: "q4", 576: "q8"}
TILE_BYTES = 1024
BF16_BLOCK_BYTES = {b + TILE_BYTES: f for b, f in CODE_BLOCK_BYTES.items()}


def code_format(w: torch.Tensor) -> str | None:
    """"q4" or "q8" for a weight packed as codes (with or without bf16
    values), None otherwise."""
    if w.dim() != 3 or w.dtype is not torch.uint8:
        return None
    return CODE_BLOCK_BYTES.get(w.shape[2]) or BF16_BLOCK_BYTES.get(w.shape[2])


def f32_codes(w: torch.Tensor) -> bool:
    """A float32 weight packed as its codes (`fit`)."""
    return code_format(w) is not None and w.shape[2] in CODE_BLOCK_BYTES


def bf16_codes(w: torch.Tensor) -> bool:
    """A bf16 weight packed as its codes and values (`with_values`)."""
    return code_format(w) is not None and w.shape[2] in BF16_BLOCK_BYTES


def code_formats(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """How many of `tensors` are packed as codes, by format ("q4", "q8")."""
    return dict(Counter(f for t in tensors if (f := code_format(t)) is not None))


def fit(w: torch.Tensor) -> torch.Tensor | None:
    """The codes of a float32 weight `[N, K]` (N a multiple of 16, K of 32)
    whose every value they give back exactly; None for any other weight."""
    if (w.dim() != 2 or w.dtype is not torch.float32 or w.device.type != "cpu"
            or w.shape[0] % 16 or w.shape[1] % 32 or w.numel() == 0):
        return None
    attention_cpp.load_kernel()
    codes = torch.ops.preempt_serve.pack_f32_codes(w.detach().contiguous())
    return codes if codes.numel() else None


def to_bf16_layout(codes: torch.Tensor) -> torch.Tensor:
    """`fit`'s codes with each block's codes reordered for the bf16 kernel
    (engine/csrc/gemm_bf16_codes.cpp decodes a line of the tiles' operand,
    16 columns' pairs of k, from one load; the scales stay as they are):
    line kp's lane 2j + e is column j's (half A) or 8 + j's (half B) code of
    k = 2 kp + e; Q4 keeps A's in a byte's low nibble and B's in its high
    one, Q8 A's 16 bytes, then B's."""
    fmt = code_format(codes)
    if fmt is None:
        raise ValueError("to_bf16_layout: not a weight's codes")
    p, kb, nbytes = codes.shape
    head = 128 if fmt == "q4" else 64
    if fmt == "q4":  # [k][8 bytes]: column j low, j + 8 high
        c = codes[..., head:].reshape(p, kb, 32, 8)
        q = torch.cat([c & 15, c >> 4], dim=-1)  # [k][16 columns]
    else:  # [k][16 columns]
        q = codes[..., head:].reshape(p, kb, 32, 16)
    q = q.reshape(p, kb, 16, 2, 16)  # [kp][e][column]
    half_a = q[..., :8].permute(0, 1, 2, 4, 3).reshape(p, kb, 16, 16)  # [kp][2j + e]
    half_b = q[..., 8:].permute(0, 1, 2, 4, 3).reshape(p, kb, 16, 16)
    lines = half_a | (half_b << 4) if fmt == "q4" else torch.cat([half_a, half_b], dim=-1)
    return torch.cat([codes[..., :head], lines.reshape(p, kb, -1)], dim=-1).contiguous()


def with_values(codes: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """A bf16 weight's codes (`fit`'s) and its values (`packed_bf16.pack`'s)
    in one uint8 buffer shaped `[N/16, K/32, bytes + 1024]`: every block's
    codes in `to_bf16_layout`'s order, then the packed values, so that each
    of engine/csrc/gemm_bf16_codes.cpp's ways (the codes at a few rows, the
    values at more) streams its own region."""
    return torch.ops.preempt_serve.pack_bf16_codes(to_bf16_layout(codes), packed)


def decodes_to(w_codes: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the codes of `w_codes` (`with_values`) decode to bf16 `w`
    `[N, K]` value for value (a zero's sign aside: it never shows in a sum
    that starts from +0)."""
    if not bf16_codes(w_codes) or w.dtype is not torch.bfloat16 or w.dim() != 2 \
            or (w_codes.shape[0] * 16, w_codes.shape[1] * 32) != tuple(w.shape):
        return False
    return torch.equal(torch.ops.preempt_serve.unpack_bf16_codes(w_codes), w)


class SourceCodes:
    """The codes of some of a model's weights (the projections', the
    head's: `wanted`, by parameter name), fitted on the float32 tensors of
    the checkpoint as they are loaded (`CausalLM.load_weights`), before a
    bf16 model rounds them.  A fused projection (`qkv`, `gate_up`) has codes
    only where every one of its parts has them, in one format: parts whose
    rows are multiples of 16 stack block for block."""

    def __init__(self, wanted: Iterable[str]) -> None:
        self.wanted = frozenset(wanted)
        # parameter -> part (None: the whole weight) -> codes (None: none fit)
        self._parts: dict[str, dict[int | None, torch.Tensor | None]] = {}

    def add(self, param: str, part: int | None, tensor: torch.Tensor) -> None:
        """`tensor`, this rank's slice of the checkpoint's weight, loaded
        into part `part` of parameter `param`."""
        if param in self.wanted:
            self._parts.setdefault(param, {})[part] = fit(tensor)

    def finish(self, parts_of: Callable[[str], int]) -> dict[str, torch.Tensor]:
        """Codes by parameter name; `parts_of(param)` says how many parts a
        fused parameter has."""
        out: dict[str, torch.Tensor] = {}
        for param, parts in self._parts.items():
            if None in parts:
                got = [parts[None]]
            else:
                got = [parts.get(i) for i in range(parts_of(param))]
            codes = [c for c in got if c is not None]
            if len(codes) == len(got) and len({c.shape[2] for c in codes}) == 1:
                out[param] = codes[0] if len(codes) == 1 else torch.cat(codes)
        self._parts.clear()
        return out
