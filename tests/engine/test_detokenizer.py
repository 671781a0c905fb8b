"""Incremental detokenization: deltas, split characters, stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import detokenizer
from engine.detokenizer import IncrementalDetokenizer
from engine.request import RequestState
from engine.sampling_params import SamplingParams
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


@pytest.mark.parametrize("decoder", ["bytes", "stream", "fallback"])
def test_deltas_concatenate_to_decode(tok: Any, decoder: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = tok.encode("Say something:", add_special_tokens=False)
    ids = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    if decoder == "stream":  # as a tokenizer that is not byte-level
        monkeypatch.setattr(detokenizer, "byte_table", lambda *a: None)
    detok = IncrementalDetokenizer(_NoBackend(tok) if decoder == "fallback" else tok, prompt)
    assert type(detok._stream).__name__ == {"bytes": "ByteLevelStream", "stream": "DecodeStream",
                                            "fallback": "_OffsetDecoder"}[decoder]
    deltas = [detok.add_token(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == detok.text
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


def test_the_stop_string_is_returned_when_asked(tok: Any) -> None:
    ids = tok.encode("alpha beta STOP gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop=True)
    emitted = ""
    for t in ids:
        emitted += detok.add_token(t)
        if detok.stopped:
            break
    assert detok.stopped and emitted == "alpha beta STOP" == detok.text


def test_special_tokens_are_kept_when_asked(tok: Any) -> None:
    ids = tok.encode("<|im_start|>user hi<|im_end|> there", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        text = "".join(detok.add_token(t) for t in ids) + detok.flush()
        assert text == tok.decode(ids, skip_special_tokens=skip)
        assert ("<|im_start|>" in text) is not skip


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


def _states(tok: Any, prompt: list[int], params: SamplingParams,
            stop_ids: frozenset[int]) -> tuple[RequestState, RequestState]:
    return tuple(  # type: ignore[return-value]
        RequestState("j", params, prompt, IncrementalDetokenizer(tok, prompt, params.stop),
                     stop_ids)
        for _ in range(2))


@pytest.mark.parametrize("end", ["length mid-character", "stop token mid-character", "length"])
def test_text_decoded_later_matches_text_decoded_at_once(tok: Any, end: str) -> None:
    """`RequestState.append_later` gives the finish reason at once and, once
    its calls run (in order, after the request ended), the same deltas as
    `append`, including the bytes of a character the last token left
    unfinished."""
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode("ok 你好 🤖🎉 done", add_special_tokens=False)
    robot = tok.encode("ok 你好 🤖", add_special_tokens=False)
    cut = len(robot) - 1  # inside the robot's bytes
    assert tok.decode(ids[:cut]).endswith("\ufffd")
    stop_ids: frozenset[int] = frozenset()
    if end == "length mid-character":
        params, feed = SamplingParams(max_tokens=cut), ids
    elif end == "stop token mid-character":
        stop_ids = frozenset([tok.eos_token_id])
        params, feed = SamplingParams(max_tokens=50), ids[:cut] + [tok.eos_token_id]
    else:
        params, feed = SamplingParams(max_tokens=len(ids)), ids
    now, later = _states(tok, prompt, params, stop_ids)
    assert later.text_can_wait
    at_once: list[str] = []
    calls = []
    reasons: list[tuple[str | None, str | None]] = []
    for t in feed:
        text, reason = now.append(t, 1000)
        decode, reason_later = later.append_later(t, 1000)
        at_once.append(text)
        calls.append(decode)
        reasons.append((reason, reason_later))
        if reason is not None:
            break
    assert [r for r, _ in reasons] == [r for _, r in reasons]
    assert reasons[-1][0] == ("stop" if "stop" in end else "length")
    assert [c() for c in calls] == at_once
    if "mid-character" in end:
        assert at_once[-1]  # the unfinished character's bytes came out at the end


def test_text_with_stop_strings_cannot_wait(tok: Any) -> None:
    params = SamplingParams(max_tokens=4, stop=["x"])
    state, _ = _states(tok, [], params, frozenset())
    assert not state.text_can_wait
    with pytest.raises(RuntimeError, match="stop strings"):
        state.append_later(5, 100)


def test_the_stop_reason_names_the_stop_string_or_stop_token_but_not_eos(tok: Any) -> None:
    ids = tok.encode("alpha beta STOP gamma", add_special_tokens=False)
    eos = tok.eos_token_id
    by_string, _ = _states(tok, [], SamplingParams(max_tokens=20, stop=["STOP"]),
                           frozenset({eos}))
    for t in ids:
        by_string.append(t, 100)
        if by_string.finish_reason:
            break
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", "STOP")
    stop_id = ids[1]
    params = SamplingParams(max_tokens=20, stop_token_ids=[stop_id])
    by_token, later = _states(tok, [], params, frozenset({eos, stop_id}))
    by_token.append(ids[0], 100)
    assert by_token.append(stop_id, 100)[1] == "stop" and by_token.stop_reason == stop_id
    later.append_later(stop_id, 100)  # the same when the text is decoded later
    assert later.stop_reason == stop_id
    by_eos, _ = _states(tok, [], params, frozenset({eos, stop_id}))
    assert by_eos.append(eos, 100)[1] == "stop" and by_eos.stop_reason is None


@pytest.mark.parametrize("stops", [["e l", "\n\n"], ["end\n\nm", "t; "], ["x"]])
def test_stops_hold_back_exactly_the_tail_that_could_begin_one(tok: Any, stops: list[str]) -> None:
    """After each token the emitted text is the decoded text up to the first
    stop string, or, before one appears, all of it but its longest tail
    that begins a stop string (checked against a brute-force reading)."""
    text = "see the cat; the elk ran. then: the end\n\nmore text x"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    deltas = []
    for k in range(1, len(ids) + 1):
        deltas.append(detok.add_token(ids[k - 1]))
        full = tok.decode(ids[:k])
        hits = [i for s in stops if (i := full.find(s)) >= 0]
        if hits:
            assert detok.stopped and detok.text == full[:min(hits)]
            break
        hold = max((n for s in stops for n in range(1, len(s)) if full.endswith(s[:n])),
                   default=0)
        assert not detok.stopped and detok.text == full[:len(full) - hold]
    assert "".join(deltas) == detok.text
    assert detok.stopped  # every parametrisation's stop string is in the text
