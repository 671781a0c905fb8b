"""vLLM's `bad_words`: words a request's answer must not contain.

A word is banned as the token sequences it is written with: alone (at the
start of a text) and after a space (inside one), as vLLM tokenizes it.  At
each step a word of one token bans that token; a longer one bans its last
token while the answer ends with the tokens before it.  So the ban follows
the tokens the model actually chose: the same word spelt with other tokens
(another split, other case) is not banned, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Encode = Callable[[str], list[int]]


def bad_words_token_ids(words: Sequence[str], encode: Encode) -> list[list[int]]:
    """The token sequences that spell `words`: each word as written (its
    leading spaces dropped) and, where that tokenizes differently, after a
    space (vLLM's `SamplingParams.update_from_tokenizer`)."""
    out: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if bare:
            out.append(bare)
        spaced = encode(" " + word.lstrip())
        # Only where the space makes a word token of its own, of the same
        # length: " foo" as [" foo"], not [" ", "foo"], which the bare
        # spelling already covers after any space token.
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def banned_by_words(words: Sequence[Sequence[int]], history: Sequence[int]) -> list[int]:
    """The tokens `words` forbid next after the answer so far `history`."""
    banned: list[int] = []
    for seq in words:
        k = len(seq) - 1
        if k > len(history):
            continue
        if k == 0 or list(history[len(history) - k:]) == list(seq[:k]):
            banned.append(seq[-1])
    return banned


def needs_history(words: Sequence[Sequence[int]]) -> bool:
    """Whether a ban depends on the answer's last tokens (a word of more
    than one token), so a step must see the previous step's token."""
    return any(len(seq) > 1 for seq in words)
