"""A request sent to the engine replica beside its admission call and then
refused (deployments/dispatch_ahead.py), on a live server: the client gets
the 429, the replica had the request and drops it, and the request that
holds the replica ends whole."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from tests.integration.conftest import SMALL_CONFIG, _deploy, _engine_handle, wait_engine_idle

pytestmark = pytest.mark.integration

APP = "ahead"
# An objective only a request with nothing ahead of it meets: admitted at
# once on an idle replica, refused while a prompt is being computed.
AHEAD_CONFIG = {**SMALL_CONFIG, "admission": {"ttft_slo_s": 0.001}}


@pytest.fixture(scope="module")
def ahead_server(server):
    from ray import serve

    yield _deploy(server, APP, AHEAD_CONFIG)
    serve.delete(APP)


def _arrivals(engine) -> int:
    return len(engine.step_trace.remote().result()["arrivals"])


def _long_then_short(url: str, engine, scheduler,
                     rng: random.Random) -> tuple[bool, httpx.Response]:
    """A 960-token prompt, then a short request while it is computed: did
    the short one reach the replica (sent ahead), and its answer."""
    wait_engine_idle(engine)
    time.sleep(1.5)  # a load report (twice a second) has counted it: nothing ahead
    before = _arrivals(engine)
    long_answer: dict = {}

    def long_request() -> None:
        r = httpx.post(url, json={"prompt": [rng.randrange(1000, 40000) for _ in range(960)],
                                  "max_tokens": 40, "ignore_eos": True, "temperature": 0},
                       timeout=300)
        long_answer.update(status=r.status_code, body=r.json())

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    # Its prompt is being computed and its admission answered (only one
    # request at a time goes ahead of its answer).
    while _arrivals(engine) == before or scheduler.stats.remote().result()["active_jobs"] == 0:
        assert time.monotonic() < deadline, "the long request never reached the engine"
        time.sleep(0.005)
    r = httpx.post(url, json={"prompt": "Hello", "max_tokens": 8}, timeout=60)
    t.join(300)
    assert long_answer["status"] == 200, long_answer
    assert long_answer["body"]["usage"]["completion_tokens"] == 40
    return _arrivals(engine) == before + 2, r


def test_a_refused_request_sent_ahead_is_dropped_by_the_replica(ahead_server) -> None:
    from ray import serve

    engine = _engine_handle(APP)
    scheduler = serve.get_deployment_handle("Scheduler", app_name=APP)
    rng = random.Random(0)
    url = f"{ahead_server}/v1/completions"
    # A first answer from an idle replica: the next request goes ahead.
    assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code == 200
    # The long request's answer names the replica only where the Scheduler
    # had no load report naming it yet (reports come twice a second): on a
    # slow host a report may win that race, and the short request then
    # waits for its answer. A few tries; one must go ahead.
    for _ in range(4):
        aborted = engine.stats.remote().result()["num_aborted"]
        ahead, r = _long_then_short(url, engine, scheduler, rng)
        if ahead:
            break
    else:
        pytest.fail("the short request never went ahead of its admission answer")
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    # It reached the replica before its answer came; the replica dropped it.
    wait_engine_idle(engine)
    assert engine.stats.remote().result()["num_aborted"] == aborted + 1
