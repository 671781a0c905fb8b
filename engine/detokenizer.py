"""Incremental detokenization with stop strings, one instance per request.

Each sampled token yields a text delta for the client's stream.  Two things
are held back: bytes of a UTF-8 character split across tokens (the tokenizer
library's `DecodeStream` buffers those, or for a byte-level tokenizer
`engine.byte_decoder.ByteLevelStream`, the same answers from a table of each
token's bytes), and any tail of the text that could be the beginning of a
stop string.  When a stop string appears, the text is cut just before it and
the request stops (OpenAI semantics: the stop string is not returned, unless
vLLM's `include_stop_str_in_output` asks for it).  `DecodeStream` starts with
the prompt as context, so the first output token gets the same leading space
it would in the full text (a byte-level token's bytes hold their own space).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.byte_decoder import ByteLevelStream, byte_table


# Context long enough for any tokenizer's spacing rules, short enough that
# finding a clean cut is cheap.
_MIN_CONTEXT = 4
_MAX_CONTEXT = 24


def _clean_context(tokenizer: Any, prompt: Sequence[int], skip_special: bool) -> list[int]:
    """The shortest prompt suffix of at least a few tokens that decodes
    without a replacement character; none if there is no such suffix."""
    prompt = list(prompt)
    for n in range(min(_MIN_CONTEXT, len(prompt)), min(_MAX_CONTEXT, len(prompt)) + 1):
        suffix = prompt[-n:]
        if "\ufffd" not in tokenizer.decode(suffix, skip_special_tokens=skip_special):
            return suffix
    return []


def warm_up(tokenizer: Any) -> None:
    """Build what requests' detokenizers share (a byte-level tokenizer's
    table, for the default `skip_special_tokens`) now rather than in the
    first request's step."""
    backend = _rust_backend(tokenizer)
    if backend is not None:
        byte_table(backend, True)


def _rust_backend(tokenizer: Any) -> Tokenizer | None:
    """The tokenizers library's `Tokenizer` behind a transformers tokenizer
    (a fast one), or None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class _OffsetDecoder:
    """For tokenizers without a Rust backend: decode a short window twice
    and emit the difference, holding back while it ends in U+FFFD."""

    def __init__(self, tokenizer: Any, context: Sequence[int], skip_special: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._ids = list(context)
        # A few context tokens suffice for the tokenizer's spacing rules.
        self._prefix = max(0, len(self._ids) - 4)
        self._read = len(self._ids)

    def step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        decode = self._tok.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        after = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if after.endswith("\ufffd"):
            return None
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        backend = _rust_backend(tokenizer)
        table = None if backend is None else byte_table(backend, skip_special_tokens)
        self._stream: ByteLevelStream | DecodeStream | _OffsetDecoder
        # One call a token: the bound step of whichever decoder there is.
        self._step: Callable[[int], str | None]
        if table is not None:
            # Byte-level tokens need no context: their bytes are their text.
            self._stream = ByteLevelStream(table)
            self._step = self._stream.step
        else:
            context = _clean_context(tokenizer, prompt_token_ids, skip_special_tokens)
            if backend is not None:
                self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
                self._step = partial(self._stream.step, backend)
            else:
                self._stream = _OffsetDecoder(tokenizer, context, skip_special_tokens)
                self._step = self._stream.step
        self.stop = tuple(stop)
        # The last characters of the stop strings' proper prefixes: text
        # ending in none of them holds nothing back (`_stop_prefix_len`).
        self._prefix_ends = frozenset(s[n - 1] for s in self.stop for n in range(1, len(s)))
        # vLLM's include_stop_str_in_output: the matched stop string ends
        # the text instead of being cut off.
        self.include_stop = include_stop
        # Tokens fed since the decoder last produced text (a split character).
        self._undecoded: list[int] = []
        self._pending = ""  # decoded, held back
        # Emitted so far, in pieces: a string grown a piece at a time is
        # copied whole each time (quadratic in the answer's length).
        self._emitted: list[str] = []
        self.stopped = False  # a stop string matched
        self.stop_reason: str | None = None  # the stop string that matched

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._emitted)

    def add_token(self, token_id: int, check_stop: bool = True) -> str:
        """Feed one output token; returns the text to emit now.

        `check_stop=False` (before min_tokens is reached) keeps stop strings
        from ending the request but still holds back their prefixes.
        """
        if self.stopped:
            raise RuntimeError("detokenizer already stopped on a stop string")
        piece = self._step(token_id)
        if piece is None:
            self._undecoded.append(token_id)
            return ""
        if self._undecoded:
            self._undecoded.clear()
        if not self.stop:  # nothing to hold back: every token's case but a few
            self._emitted.append(piece)
            return piece
        self._pending += piece
        if check_stop:
            hit = self._find_stop()
            if hit is not None:
                cut, self.stop_reason = hit
                delta = self._pending[:cut + (len(self.stop_reason) if self.include_stop else 0)]
                self._pending = ""
                self.stopped = True
                self._emitted.append(delta)
                return delta
        hold = self._stop_prefix_len()
        delta = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """Emit everything held back (the request ended for another reason).

        A character left incomplete by the last tokens is decoded as the
        tokenizer would (usually U+FFFD), matching `tokenizer.decode`.
        """
        tail = ""
        if self._undecoded:
            tail = self._tokenizer.decode(self._undecoded, skip_special_tokens=self._skip)
            self._undecoded.clear()
        delta = self._pending + tail
        self._pending = ""
        self._emitted.append(delta)
        return delta

    # Internals ----------------------------------------------------------

    def _find_stop(self) -> tuple[int, str] | None:
        # Stop strings cannot start inside emitted text: any emitted tail
        # that could begin one was held back (`_stop_prefix_len`).
        hits = [(i, s) for s in self.stop if (i := self._pending.find(s)) >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the pending text that begins a stop string."""
        if not self._pending or self._pending[-1] not in self._prefix_ends:
            return 0
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:n]):
                    best = n
                    break
        return best
