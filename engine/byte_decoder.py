"""Streaming text of a byte-level BPE tokenizer from a table of each
token's bytes.

A byte-level tokenizer (GPT-2's scheme: SmolLM2, Llama 3, Qwen) spells
every byte of its text as one of 256 printable characters, and its decoder
maps each token's characters back to bytes, joins the bytes of all tokens
and reads them as UTF-8, an invalid or cut sequence as U+FFFD.  So the text
a token adds depends only on the bytes not yet read, and a step of the
tokenizer library's `DecodeStream` (which decodes a window of tokens twice
through Rust, 0.9–2 µs a token) reduces to a table lookup and one UTF-8
read of the held bytes.  `ByteLevelStream.step` answers exactly as
`DecodeStream.step` does: a piece of text, or None while the held bytes end
in an incomplete character, or when a token adds no bytes (a skipped
special token, an id outside the vocabulary).

The table is built only for a tokenizer whose decoder is `ByteLevel` alone,
and checked token by token against the tokenizer's own decode at build time
(about 0.12 s for 49,152 tokens, once per tokenizer and mode in a
process); any token that disagrees leaves the tokenizer on `DecodeStream`.
"""

from __future__ import annotations

import functools
import hashlib

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel


def _char_bytes() -> dict[str, int]:
    """Each of the 256 characters a byte-level tokenizer spells bytes with,
    and its byte (GPT-2's `bytes_to_unicode`, inverted): printable Latin-1
    bytes stand for themselves, the others for 256 + their rank."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    shifted = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(shifted))
    return {c: b for b, c in chars.items()}


# Tables by the tokenizer's serialized form and mode: every runner loads its
# own tokenizer object, and a test session or a process with several
# runners would otherwise build the same table again.
_BY_CONTENT: dict[tuple[str, bool], tuple[bytes, ...] | None] = {}


@functools.lru_cache(maxsize=16)
def byte_table(backend: Tokenizer, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
    """Each token id's bytes as `backend` decodes them (empty for a special
    token that `skip_special_tokens` drops), or None where `backend` is not
    a byte-level tokenizer or a token's bytes do not read as its decode."""
    if not isinstance(backend.decoder, ByteLevel):
        return None
    key = (hashlib.sha256(backend.to_str().encode()).hexdigest(), skip_special_tokens)
    if key not in _BY_CONTENT:
        _BY_CONTENT[key] = _build(backend, skip_special_tokens)
    return _BY_CONTENT[key]


def _build(backend: Tokenizer, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
    char_bytes = _char_bytes()
    alphabet = frozenset(char_bytes)
    as_latin1 = {ord(c): chr(b) for c, b in char_bytes.items()}  # for str.translate
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    table = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i)
        if token is None or (skip_special_tokens and i in special):
            raw = b""
        elif alphabet.issuperset(token):
            raw = token.translate(as_latin1).encode("latin-1")
        else:  # an added token outside the byte alphabet: its own text
            raw = token.encode()
        if backend.decode([i], skip_special_tokens=skip_special_tokens) != raw.decode(
                "utf-8", "replace"):
            return None
        table.append(raw)
    return tuple(table)


class ByteLevelStream:
    """`DecodeStream` of a byte-level tokenizer: the bytes since the last
    piece of text, read when a token completes them."""

    __slots__ = ("_table", "_held")

    def __init__(self, table: tuple[bytes, ...]) -> None:
        self._table = table
        self._held = b""

    def step(self, token_id: int) -> str | None:
        table = self._table
        held = self._held + (table[token_id] if token_id < len(table) else b"")
        if not held:
            return None
        text = held.decode("utf-8", "replace")
        if text.endswith("\ufffd"):  # a character still cut (or invalid at the end)
            self._held = held
            return None
        self._held = b""
        return text
