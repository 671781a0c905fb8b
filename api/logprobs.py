"""Logprobs in OpenAI's two response formats, from the engine's token ids.

The engine returns ids and numbers (`WireLogprob`); the strings a client
sees are made here, where the tokenizer lives.  A token's string is its
own decoding (as vLLM gives it: a token holding part of a UTF-8 character
decodes to U+FFFD), and its `bytes` are the exact bytes it stands for, so
a client can reassemble split characters as OpenAI's format intends.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from api.protocol import WireLogprob

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character map (byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()


class TokenText:
    """Each token id's string and bytes, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def _bytes(self, token_id: int) -> tuple[int, ...]:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return tuple(self.text(token_id).encode())
        if piece in self._special:
            return tuple(piece.encode())
        m = _BYTE_TOKEN.match(piece)  # sentencepiece byte fallback
        if m:
            return (int(m.group(1), 16),)
        if all(c in _BYTES for c in piece):  # byte-level BPE
            return tuple(_BYTES[c] for c in piece)
        return tuple(piece.replace("\u2581", " ").encode())


Entry = tuple[int, WireLogprob | None]


def _label(tt: TokenText, token_id: int, as_ids: bool) -> str:
    """A token's name in logprobs: its text, or (vLLM's
    `return_tokens_as_token_ids`) "token_id:<id>", which names a token whose
    text alone is ambiguous (a piece of a UTF-8 character, a special token)."""
    return f"token_id:{token_id}" if as_ids else tt.text(token_id)


def completion_logprobs(entries: list[Entry], tt: TokenText, offset: int = 0,
                        as_ids: bool = False) -> tuple[dict[str, Any], int]:
    """The completions format for `(token id, logprob)` entries, and the
    text offset after them (`text_offset` counts characters of the text
    returned so far, echoed prompt included, whatever names the tokens).  A
    prompt's first token has no logprob (None)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for token_id, lp in entries:
        text = _label(tt, token_id, as_ids)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(tt.text(token_id))
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(lp.logprob)
        # As vLLM: the sampled token is always listed beside the top ones.
        top = {_label(tt, t, as_ids): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)
        out["top_logprobs"].append(top)
    return out, offset


def prompt_logprobs(entries: list[Entry], tt: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first),
    `{token id: {logprob, rank, decoded_token}}` for the prompt's token and
    the most likely alternatives at that position."""
    out: list[dict[str, Any] | None] = []
    for token_id, lp in entries:
        if lp is None:
            out.append(None)
            continue
        at = {str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                              "decoded_token": tt.text(token_id)}}
        for rank, (t, v) in enumerate(lp.top, 1):
            at.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": tt.text(t)})
        out.append(at)
    return out


def chat_logprobs(entries: list[Entry], tt: TokenText, as_ids: bool = False
                  ) -> dict[str, Any]:
    """The chat format: `{"content": [{token, logprob, bytes, top_logprobs}]}`;
    `bytes` are the token's own bytes, whatever names it."""
    content = []
    for token_id, lp in entries:
        if lp is None:
            continue
        content.append({
            "token": _label(tt, token_id, as_ids),
            "logprob": lp.logprob,
            "bytes": list(tt.bytes(token_id)),
            "top_logprobs": [
                {"token": _label(tt, t, as_ids), "logprob": v, "bytes": list(tt.bytes(t))}
                for t, v in lp.top
            ],
        })
    return {"content": content}
