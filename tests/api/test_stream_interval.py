"""The server's `stream_interval` reaches the engine with each request."""

from __future__ import annotations

import pytest

from tests.api.harness import harness


@pytest.mark.parametrize("interval", [None, 4])
def test_each_request_carries_the_servers_stream_interval(interval: int | None) -> None:
    config = {} if interval is None else {"stream_interval": interval}
    with harness(**config) as h:
        for stream in (True, False):
            r = h.client.post("/v1/chat/completions", json={
                "model": h.model_name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3, "stream": stream})
            assert r.status_code == 200, r.text
        got = [(g.streamed, g.stream_interval) for g in h.engine.requests]
        assert got == [(True, interval or 1), (False, interval or 1)]


def test_a_stream_interval_below_one_fails_at_start_by_name() -> None:
    from pydantic import ValidationError

    from api.config import AppConfig

    with pytest.raises(ValidationError, match="stream_interval"):
        AppConfig(model="embedded:smollm2", stream_interval=0)
