"""The real Serve application, driven by the official `openai` client."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.integration.conftest import wait_engine_idle

pytestmark = pytest.mark.integration


def client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(server):
    data = client(server).models.list().data
    assert [m.id for m in data] == ["smollm2"]


def test_streaming_chat_completion(server, engine_handle):
    stream = client(server).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    text = "".join(pieces)
    assert "Paris" in text
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    wait_engine_idle(engine_handle)


def test_non_streaming_completion_is_greedy_deterministic(server):
    c = client(server)
    kw = dict(model="smollm2", prompt="The three primary colors are", max_tokens=12,
              temperature=0, ignore_eos=True)
    a = c.completions.create(**{k: v for k, v in kw.items() if k != "ignore_eos"},
                             extra_body={"ignore_eos": True})
    b = c.completions.create(**{k: v for k, v in kw.items() if k != "ignore_eos"},
                             extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text.strip()
    assert a.usage.completion_tokens == 12
    assert a.choices[0].finish_reason == "length"
    assert a.model_extra["metrics"]["e2e"] > 0


def test_an_unstreamed_answer_comes_in_few_items_with_the_same_tokens(server, engine_handle):
    """The engine holds a non-streaming client's output back (at most every
    HOLD_UNSTREAMED_S) instead of sending an item a token; the answer is the
    same (greedy, float32)."""
    import time

    from api.protocol import GenerateRequest
    from deployments.stream_pacing import HOLD_UNSTREAMED_S

    stream_handle = engine_handle.options(stream=True)

    def run(streamed: bool) -> tuple[list[int], int, float]:
        req = GenerateRequest(
            request_id=f"held-{streamed}", prompt_token_ids=[1, 504, 3458, 28, 253],
            max_tokens=48, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=[],
            stop_token_ids=[], ignore_eos=True, min_tokens=0, arrival_time=time.time(),
            streamed=streamed)
        tokens: list[int] = []
        items = 0
        t0 = time.monotonic()
        for item in stream_handle.generate.remote([req.model_dump()]):
            items += 1
            for d in item:
                tokens += d["token_ids"]
        return tokens, items, time.monotonic() - t0

    streamed_tokens, streamed_items, _ = run(True)
    held_tokens, held_items, took = run(False)
    assert held_tokens == streamed_tokens and len(held_tokens) == 48
    assert streamed_items >= 24  # about an item an iteration
    assert held_items <= took / HOLD_UNSTREAMED_S + 2
    assert held_items < streamed_items
    wait_engine_idle(engine_handle)


def test_a_stream_interval_groups_tokens_after_the_first(server, engine_handle):
    """With `stream_interval` 4 (the server's setting, carried by each
    request) a streamed request's first token comes alone, then its tokens
    in items of up to 4: the same tokens (greedy, float32) in fewer items."""
    import time

    from api.protocol import GenerateRequest

    stream_handle = engine_handle.options(stream=True)

    def run(interval: int) -> list[list[int]]:
        req = GenerateRequest(
            request_id=f"interval-{interval}", prompt_token_ids=[1, 504, 3458, 28, 253],
            max_tokens=33, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=[],
            stop_token_ids=[], ignore_eos=True, min_tokens=0, arrival_time=time.time(),
            stream_interval=interval)
        return [sum((d["token_ids"] for d in item), [])
                for item in stream_handle.generate.remote([req.model_dump()])]

    one, four = run(1), run(4)
    assert sum(one, []) == sum(four, []) and len(sum(four, [])) == 33
    assert len(four[0]) == 1
    # Each later item holds up to 4 tokens; fewer only when held past the
    # linger time (a slow step) or at the end.
    assert all(1 <= len(item) <= 4 for item in four[1:])
    assert len(four) < len(one)
    wait_engine_idle(engine_handle)


def test_the_plan_trace_records_each_request_reaching_the_replica(server, engine_handle):
    """`step_trace` (what `bench trace-live` saves): each request's arrival
    at the engine replica, on the plans' clock, before its first plan."""
    before = len(engine_handle.step_trace.remote().result()["arrivals"])
    c = client(server)
    for prompt in ("One, two,", "Red, green,"):
        c.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=0)
    trace = engine_handle.step_trace.remote().result()
    arrivals = trace["arrivals"][before:]
    assert len(arrivals) == 2
    for t, request_id in arrivals:
        first_plan = min(r["t"] for r in trace["plans"] if request_id in r["jobs"])
        assert t <= first_plan < t + 60
    wait_engine_idle(engine_handle)


def test_stop_string_is_honoured(server):
    r = client(server).completions.create(
        model="smollm2", prompt="1, 2, 3, 4,", max_tokens=30, temperature=0,
        stop=[" 7"])
    assert r.choices[0].finish_reason == "stop"
    assert " 7" not in r.choices[0].text


def test_aborted_stream_frees_its_blocks(server, engine_handle):
    body = {"model": "smollm2", "prompt": "Tell me a very long story.", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", f"{server}/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen += 1
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
    stats = wait_engine_idle(engine_handle)
    assert stats["num_aborted"] >= 1
    # The Scheduler hears of the end too, though the client left mid-stream.
    from ray import serve

    scheduler = serve.get_deployment_handle("Scheduler", app_name="llm")
    deadline = time.monotonic() + 10
    while scheduler.stats.remote().result()["active_jobs"]:
        assert time.monotonic() < deadline, "the scheduler never released the job"
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/chat/completions", {"model": "smollm2"}, 400, "messages"),
        ("/v1/completions", {"model": "smollm2"}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi " * 1100, "max_tokens": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ],
)
def test_bad_requests_get_openai_errors_and_server_keeps_serving(
        server, engine_handle, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}{path}", content=content,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] == status
    if param is not None:
        assert err["param"].startswith(param)
    ok = httpx.post(f"{server}/v1/completions", timeout=60,
                    json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200
    wait_engine_idle(engine_handle)
