"""OpenAI responses built from engine deltas: choice indexing, usage, echo,
logprobs in both formats, and the stream's chunks."""

from __future__ import annotations

import math
from typing import Any

import pytest

from api.logprobs import TokenText
from api.responses import PromptInput, ResponseBuilder


@pytest.fixture(scope="module")
def tokens() -> TokenText:
    from transformers import AutoTokenizer

    from engine.model_source import resolve_model

    return TokenText(AutoTokenizer.from_pretrained(resolve_model("embedded:smollm2")))


def delta(index: int, ids: list[int], text: str, finish: str | None = None,
          logprobs: list[dict[str, Any]] | None = None, prompt_logprobs: Any = None,
          prompt: int = 0) -> dict[str, Any]:
    return {"prompt": prompt, "index": index, "token_ids": ids, "text": text, "finish_reason": finish,
            "metrics": {"ttft": 0.1} if finish else None, "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs}


def lp(value: float, *top: tuple[int, float]) -> dict[str, Any]:
    return {"logprob": value, "top": list(top)}


def test_batch_prompts_with_n_choices_index_prompt_major_and_sum_usage(tokens: TokenText) -> None:
    prompts = [PromptInput([1, 2, 3], "a"), PromptInput([4, 5], "b")]
    b = ResponseBuilder("cmpl-x", "m", 0, chat=False, prompts=prompts, n=2, tokens=tokens)
    b.apply(delta(1, [7, 8], "yz", "length", prompt=1), emit=False)
    b.apply(delta(0, [9], "q", "stop"), emit=False)
    assert not b.done
    b.apply(delta(1, [10], "r", "stop"), emit=False)
    b.apply(delta(0, [11, 12, 13], "stu", "length", prompt=1), emit=False)
    assert b.done
    r = b.response()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in r["choices"]] == [
        (0, "q", "stop"), (1, "r", "stop"), (2, "stu", "length"), (3, "yz", "length")]
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                          "prompt_tokens_details": {"cached_tokens": 0}}


def test_cached_prompt_tokens_count_once_per_prompt(tokens: TokenText) -> None:
    prompts = [PromptInput(list(range(40)), "a"), PromptInput(list(range(20)), "b")]
    b = ResponseBuilder("cmpl-x", "m", 0, chat=False, prompts=prompts, n=2, tokens=tokens)
    for prompt, index, cached in ((0, 0, 32), (0, 1, 0), (1, 0, 0), (1, 1, 16)):
        d = delta(index, [9], "q", "stop", prompt=prompt)
        d["metrics"] = {"ttft": 0.1, "cached_tokens": cached}
        b.apply(d, emit=False)
    assert b.response()["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}


def test_echo_with_logprobs_returns_the_prompt_tokens_first(tokens: TokenText) -> None:
    prompt_ids = [19556, 905]  # "Hello" " world" in SmolLM2's vocabulary
    text = tokens.text(prompt_ids[0]) + tokens.text(prompt_ids[1])
    b = ResponseBuilder("cmpl-x", "m", 0, chat=False,
                        prompts=[PromptInput(prompt_ids, text)], n=1, tokens=tokens,
                        logprobs=True, echo=True)
    b.apply(delta(0, [30], tokens.text(30), "length",
                     logprobs=[lp(-0.5, (30, -0.5), (31, -1.5))],
                     prompt_logprobs=[None, lp(-2.0, (40, -0.1))]), emit=False)
    choice = b.response()["choices"][0]
    assert choice["text"] == text + tokens.text(30)
    got = choice["logprobs"]
    assert got["tokens"] == [tokens.text(t) for t in prompt_ids + [30]]
    assert got["token_logprobs"] == [None, -2.0, -0.5]
    assert got["top_logprobs"][0] is None
    # The sampled (here: prompt) token is listed beside the top alternatives.
    assert got["top_logprobs"][1] == {tokens.text(40): -0.1, tokens.text(905): -2.0}
    assert got["text_offset"] == [0, len(tokens.text(prompt_ids[0])), len(text)]


def test_chat_logprobs_carry_exact_bytes_of_split_characters(tokens: TokenText) -> None:
    # "😀" is split over two byte-level tokens; each alone decodes to U+FFFD.
    ids = [40303, 218]
    b = ResponseBuilder("chatcmpl-x", "m", 0, chat=True, prompts=[PromptInput([1], "")], n=1,
                        tokens=tokens, logprobs=True)
    b.apply(delta(0, ids, " 😀", "stop", logprobs=[lp(-1.0), lp(-0.25, (218, -0.25))]),
            emit=False)
    content = b.response()["choices"][0]["logprobs"]["content"]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == " 😀"
    assert content[1]["top_logprobs"] == [{"token": tokens.text(218), "logprob": -0.25,
                                           "bytes": content[1]["bytes"]}]
    assert content[0]["top_logprobs"] == []
    assert all(math.isfinite(c["logprob"]) for c in content)


def test_chat_stream_opens_every_choice_and_ends_each_with_its_metrics(tokens: TokenText) -> None:
    b = ResponseBuilder("chatcmpl-x", "m", 5, chat=True, prompts=[PromptInput([1, 2], "")],
                        n=2, tokens=tokens)
    opening = b.opening_chunks()
    assert [c["choices"][0]["delta"] for c in opening] == [{"role": "assistant", "content": ""}] * 2
    chunks = b.apply(delta(1, [5], "hi", "stop"))
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "hi"}, {}]
    assert chunks[-1]["choices"][0] == {"index": 1, "delta": {}, "logprobs": None,
                                        "finish_reason": "stop", "stop_reason": None}
    assert chunks[-1]["metrics"] == {"ttft": 0.1}
    assert all(c["object"] == "chat.completion.chunk" and c["created"] == 5 for c in chunks)
    b.apply(delta(0, [6, 7], "yo", "length"))
    assert b.usage_chunk()["usage"]["completion_tokens"] == 3


def test_prompt_logprobs_in_vllms_shape(tokens: TokenText) -> None:
    """vLLM's `prompt_logprobs`: on each completion choice, at the top of a
    chat response; per prompt token (None for the first) the token and the
    alternatives, each with its logprob, rank and text."""
    prompt_ids = [19556, 905]
    plps = [None, {"logprob": -2.0, "top": [(40, -0.1), (905, -2.0)], "rank": 2}]
    want = [None, {"905": {"logprob": -2.0, "rank": 2, "decoded_token": tokens.text(905)},
                   "40": {"logprob": -0.1, "rank": 1, "decoded_token": tokens.text(40)}}]
    for chat in (False, True):
        b = ResponseBuilder("x", "m", 0, chat=chat, prompts=[PromptInput(prompt_ids, "")], n=2,
                            tokens=tokens, prompt_logprobs=True)
        for index in (0, 1):
            b.apply(delta(index, [30], "a", "length", prompt_logprobs=plps), emit=False)
        out = b.response()
        if chat:
            assert out["prompt_logprobs"] == want
            assert all("prompt_logprobs" not in c for c in out["choices"])
        else:
            assert [c["prompt_logprobs"] for c in out["choices"]] == [want, want]
            assert "prompt_logprobs" not in out
    # Not asked for (an echo's internal prompt logprobs): not returned.
    b = ResponseBuilder("x", "m", 0, chat=False, prompts=[PromptInput(prompt_ids, "")], n=1,
                        tokens=tokens)
    b.apply(delta(0, [30], "a", "length", prompt_logprobs=plps), emit=False)
    assert "prompt_logprobs" not in b.response()["choices"][0]
