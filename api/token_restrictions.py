"""vLLM's `allowed_token_ids` and `bad_words` on chat and completion
requests: the tokens an answer may be sampled from, and words it may not
contain (engine/bad_words.py says how a word is banned)."""

from __future__ import annotations

from pydantic import Field, field_validator

from api.unsupported import UnsupportedFields

_I32_MAX = 2**31 - 1
# Each bad word is checked against the answer's end for every token: the
# bound keeps that a small part of a step.
MAX_BAD_WORDS = 100


class TokenRestrictions(UnsupportedFields):
    # Validators are named apart from the subclasses' (a method of the same
    # name in a subclass would replace one).
    # Only these token ids may be sampled (EOS among them or the answer
    # runs to max_tokens).
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    # Words the answer must not contain, as the model would write them.
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(not 0 <= t <= _I32_MAX for t in v):
            raise ValueError("allowed_token_ids must be token ids (non-negative)")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not w.strip() or len(w) > 1024 for w in v):
            raise ValueError("bad_words must be words: not blank, at most 1,024 characters")
        return v
