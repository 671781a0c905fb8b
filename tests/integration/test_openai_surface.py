"""The OpenAI request surface, live: logprobs, echo, penalties, logit bias,
n > 1 over shared prompt KV, batches of prompts, admission control's 429.

Greedy and seeded outputs are compared with single requests of the same
application (float32, conftest.py), so any sharing or batching error shows
as different text."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from tests.integration.conftest import wait_engine_idle

pytestmark = pytest.mark.integration

PROMPT = "The history of the printing press begins"


def complete(base: str, **body) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_logprobs_are_a_distribution_and_greedy_picks_the_top(server):
    r = complete(server, max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 8
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and len(top) in (3, 4) and top[tok] == value
        # Greedy: the sampled token is the most likely one.
        assert value == pytest.approx(max(top.values()))
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-4
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_with_logprobs_scores_the_prompt(server):
    r = complete(server, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = r["choices"][0]
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None
    assert len(lp["tokens"]) == r["usage"]["prompt_tokens"] + 1
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == choice["text"]


def test_chat_logprobs_with_top_alternatives(server):
    r = httpx.post(f"{server}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6,
        "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for c in content:
        assert len(c["top_logprobs"]) == 2 and c["logprob"] == pytest.approx(
            c["top_logprobs"][0]["logprob"])
    assert bytes(b for c in content for b in c["bytes"]).decode() == r["choices"][0][
        "message"]["content"] or r["choices"][0]["finish_reason"] == "stop"


def test_logit_bias_bans_and_forces_tokens(server):
    from transformers import AutoTokenizer

    from engine.model_source import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("embedded:smollm2"))
    greedy = complete(server, max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    first = greedy["choices"][0]["logprobs"]["tokens"][0]
    (first_id,) = tok.encode(first, add_special_tokens=False)
    banned = complete(server, max_tokens=6, temperature=0, ignore_eos=True, logprobs=0,
                      logit_bias={str(first_id): -100})
    assert first not in banned["choices"][0]["logprobs"]["tokens"]
    forced = complete(server, max_tokens=4, temperature=0, ignore_eos=True, logprobs=0,
                      logit_bias={"2000": 100})
    assert forced["choices"][0]["logprobs"]["tokens"] == [tok.decode([2000])] * 4


def test_frequency_penalty_stops_greedy_repetition(server):
    body = {"prompt": "one one one one one one", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    plain = complete(server, **body)["choices"][0]["logprobs"]["tokens"]
    penalized = complete(server, **body, frequency_penalty=2.0)["choices"][0]["logprobs"]["tokens"]
    assert max(plain.count(t) for t in plain) > max(penalized.count(t) for t in penalized)


def test_n_choices_share_the_prompt_and_match_single_seeded_requests(server, engine_handle):
    before = wait_engine_idle(engine_handle)
    # Several full KV blocks to share, and an open-ended continuation.
    prompt = ("My grandmother kept a notebook of odd facts she collected on her travels "
              "through small towns, markets and harbours. On the first page she wrote:")
    r = complete(server, prompt=prompt, n=3, seed=11, temperature=1.0, max_tokens=10,
                 ignore_eos=True)
    after = wait_engine_idle(engine_handle)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 30
    n_prompt = r["usage"]["prompt_tokens"]
    # Two of the three choices reused the first one's full prompt blocks.
    shared = after["shared_prompt_tokens"] - before["shared_prompt_tokens"]
    assert shared == 2 * ((n_prompt - 1) // 16 * 16)
    texts = [c["text"] for c in r["choices"]]
    assert len(set(texts)) >= 2  # the choices are sampled apart
    for i, text in enumerate(texts):  # choice i is seeded seed + i
        alone = complete(server, prompt=prompt, seed=11 + i, temperature=1.0, max_tokens=10,
                         ignore_eos=True)
        assert alone["choices"][0]["text"] == text


def test_batched_prompts_and_streamed_choices(server, engine_handle):
    single = [complete(server, prompt=p, max_tokens=5, temperature=0, ignore_eos=True)
              ["choices"][0]["text"] for p in ("Red", "Blue")]
    with httpx.stream("POST", f"{server}/v1/completions", timeout=300, json={
            "prompt": ["Red", "Blue"], "n": 2, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as s:
        texts: dict[int, str] = {}
        finished, usage = set(), None
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            import json

            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    finished.add(c["index"])
    assert finished == {0, 1, 2, 3}
    assert [texts[i] for i in range(4)] == [single[0], single[0], single[1], single[1]]
    assert usage["completion_tokens"] == 20
    wait_engine_idle(engine_handle)


def test_admission_control_answers_429_with_retry_after(tight_server, tight_engine):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(c.post(f"{tight_server}/v1/completions", json={
                "prompt": f"Count to {i}:", "max_tokens": 40, "ignore_eos": True,
                "temperature": 0}) for i in range(16)))

    # Wait for the replica's first load report, which carries its bound.
    import time

    time.sleep(1.5)
    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429}, [r.text for r in rs if r.status_code not in (200, 429)]
    assert 0 < codes.count(429) < len(codes), codes
    for r in rs:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 40
    wait_engine_idle(tight_engine)
