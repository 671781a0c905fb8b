"""Property-based corpus: whatever a client sends, the ingress answers
below 500; every non-2xx is OpenAI's JSON error with `code` equal to the
status, every 2xx completion has OpenAI's shape, and every admitted job is
released.

Derandomized, so CI runs the same examples every time.  Set
PREEMPT_SERVE_FUZZ_EXAMPLES to run more (e.g. 5000) when hunting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.api.conftest import API_KEY
from tests.api.harness import Harness
from tests.api.shapes import assert_completion, assert_error
from tests.api.strategies import (
    CHAT,
    COMPLETIONS,
    CONTENT_TYPES,
    HEADER_TEXT,
    KEYS,
    METHODS,
    PATHS,
    RAW_BODIES,
    WILD,
    encode,
    mutated_request,
)

EXAMPLES = int(os.environ.get("PREEMPT_SERVE_FUZZ_EXAMPLES", "120"))


def fuzz(share: float) -> settings:
    return settings(max_examples=max(1, int(EXAMPLES * share)), deadline=None,
                    derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much,
                                           HealthCheck.large_base_example])


def check_answer(r: httpx2.Response, method: str = "POST") -> None:
    """Below 500, and a JSON error body for every non-2xx (HEAD has no body)."""
    event(f"status {r.status_code}")  # --hypothesis-show-statistics tallies them
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 300 and method != "HEAD":
        assert_error(r)


def check_released(h: Harness) -> None:
    """Every admitted job gets released; the release runs just after the
    response, on the app's event loop."""
    deadline = time.monotonic() + 2.0
    while True:
        missing = {a[0] for a in h.scheduler.admitted} - set(h.scheduler.released)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    assert not missing, f"admitted but never released: {sorted(missing)[:3]}"


def json_post(h: Harness, path: str, content: bytes,
              headers: dict[str, str] | None = None) -> httpx2.Response:
    return h.client.post(path, content=content,
                         headers={"content-type": "application/json", **(headers or {})})


@given(request=mutated_request(), ascii_only=st.booleans())
@fuzz(share=3.0)
def test_mutated_requests(served: Harness, request: tuple[str, dict[str, Any]],
                          ascii_only: bool) -> None:
    path, body = request
    r = json_post(served, path, encode(body, ascii_only))
    check_answer(r)
    if r.status_code == 200:
        assert_completion(r, path, body)
    check_released(served)


@given(path=st.sampled_from([COMPLETIONS, CHAT]),
       body=st.dictionaries(KEYS, WILD, max_size=6), ascii_only=st.booleans())
@fuzz(share=1.0)
def test_wild_objects(served: Harness, path: str, body: dict[str, Any],
                      ascii_only: bool) -> None:
    r = json_post(served, path, encode(body, ascii_only))
    check_answer(r)
    if r.status_code == 200:
        assert_completion(r, path, body)


@given(path=st.sampled_from([COMPLETIONS, CHAT]), body=RAW_BODIES,
       content_type=CONTENT_TYPES, chunked=st.booleans())
@fuzz(share=1.0)
def test_raw_bodies(served: Harness, path: str, body: bytes, content_type: str | None,
                    chunked: bool) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    content: bytes | Iterator[bytes] = body
    if chunked:  # no Content-Length: the limit is enforced while reading
        content = iter([body[i:i + 7] for i in range(0, len(body), 7)])
    r = served.client.post(path, content=content, headers=headers)
    check_answer(r)
    assert r.status_code != 200, "no random bytes make a request"


AUTH_HEADERS = st.one_of(
    st.none(),
    st.just(f"Bearer {API_KEY}"),
    st.sampled_from(["Bearer", "Bearer ", f"bearer {API_KEY}", f"Basic {API_KEY}", API_KEY,
                     f"Bearer {API_KEY} ", f"Bearer {API_KEY[:-1]}", f"Bearer  {API_KEY}"]),
    HEADER_TEXT.map(lambda t: f"Bearer {t}"),
    HEADER_TEXT,
)


def key_accepted(header: str | None) -> bool:
    if header is None:
        return False
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and token.strip() == API_KEY


@given(path=PATHS, method=METHODS, content_type=CONTENT_TYPES, authorization=AUTH_HEADERS,
       body=st.one_of(st.just(b""), st.just(b'{"prompt": "Hi", "max_tokens": 2}'),
                      RAW_BODIES),
       with_key=st.booleans())
@fuzz(share=1.5)
def test_any_route_method_and_headers(served: Harness, keyed: Harness, path: str,
                                      method: str, content_type: str | None,
                                      authorization: str | None, body: bytes,
                                      with_key: bool) -> None:
    h = keyed if with_key else served
    headers = {}
    if content_type is not None:
        headers["content-type"] = content_type
    if authorization is not None:
        headers["authorization"] = authorization
    url = httpx2.URL(f"http://testserver{path}")  # absolute: a path may start "//"
    r = h.client.request(method, url, content=body, headers=headers)
    check_answer(r, method)
    route = url.path
    if with_key and route != "/health":
        assert (r.status_code == 401) == (not key_accepted(authorization)), (
            r.status_code, authorization)
    if r.status_code == 200 and method == "POST":
        # Only a JSON object that is a valid request is served.
        assert route in (COMPLETIONS, CHAT), route


@pytest.mark.parametrize("with_key", [False, True])
def test_corpus_harness_serves_a_plain_request(served: Harness, keyed: Harness,
                                               with_key: bool) -> None:
    # The corpus is only as good as its happy path: make sure one exists.
    h = keyed if with_key else served
    body = {"prompt": "Hello", "max_tokens": 2}
    headers = {"authorization": f"Bearer {API_KEY}"} if with_key else {}
    r = h.client.post(COMPLETIONS, json=body, headers=headers)
    assert_completion(r, COMPLETIONS, body)
