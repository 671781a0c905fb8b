"""Incremental detokenization: deltas, split characters, stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import load_tokenizer

TEXT = "Héllo wörld! 你好世界 🤖🎉 naïve café — done.\nNext line: ok"


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Any:
    return load_tokenizer(smollm2_path)


class _NoBackend:
    """A tokenizer without a Rust backend (exercises the fallback decoder)."""

    def __init__(self, tok: Any) -> None:
        self._inner = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("fallback", [False, True])
def test_deltas_concatenate_to_decode(tok: Any, fallback: bool) -> None:
    prompt = tok.encode("Say something:", add_special_tokens=False)
    ids = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(_NoBackend(tok) if fallback else tok, prompt)
    deltas = [detok.add_token(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    # Split characters are held back, never streamed as U+FFFD.
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some token completed no character


def test_unfinished_character_is_flushed_like_decode(tok: Any) -> None:
    ids = tok.encode("ok 🤖", add_special_tokens=False)
    ids = ids[:-1]  # cut the emoji's last byte-token
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.add_token(t) for t in ids) + detok.flush()
    assert text == tok.decode(ids)


def test_stop_string_truncates_and_holds_back(tok: Any) -> None:
    ids = tok.encode("alpha beta STOP gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    emitted = ""
    for t in ids:
        emitted += detok.add_token(t)
        # Never a possible beginning of the stop string at the end.
        assert not any(emitted.endswith("STOP"[:n]) for n in range(1, 5))
        if detok.stopped:
            break
    assert detok.stopped and detok.stop_reason == "STOP"
    assert emitted == "alpha beta " == detok.text


def test_held_prefix_is_released_when_it_does_not_complete(tok: Any) -> None:
    ids = tok.encode("a ST b", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas = [detok.add_token(t) for t in ids]
    assert not detok.stopped
    assert "".join(deltas) + detok.flush() == "a ST b"


def test_earliest_of_several_stops_wins(tok: Any) -> None:
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["four", "two"])
    text = ""
    for t in ids:
        text += detok.add_token(t)
        if detok.stopped:
            break
    assert text == "one " and detok.stop_reason == "two"


def test_check_stop_false_ignores_stop_strings(tok: Any) -> None:
    ids = tok.encode("x STOP y", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    text = "".join(detok.add_token(t, check_stop=False) for t in ids) + detok.flush()
    assert text == "x STOP y" and not detok.stopped


def test_prompt_with_broken_tail_does_not_leak(tok: Any) -> None:
    emoji = tok.encode("🤖", add_special_tokens=False)
    assert len(emoji) > 1
    prompt = tok.encode("Hello", add_special_tokens=False) + emoji[:1]
    ids = tok.encode(" world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.add_token(t) for t in ids) + detok.flush() == " world"
