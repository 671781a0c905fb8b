"""The ingress's calls on the request path (admission, the engine stream,
release) go on handles that send them by value over Serve's gRPC data plane
(deployments/handles.py); other calls keep the actor-task path."""

from __future__ import annotations

from typing import Any

from deployments.handles import by_value
from tests.api.harness import harness


def _chat(h: Any, stream: bool) -> None:
    r = h.client.post("/v1/chat/completions", json={
        "model": h.model_name, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4, "stream": stream})
    assert r.status_code == 200, r.text


def test_admission_and_the_engine_stream_go_by_value() -> None:
    with harness() as h:
        _chat(h, stream=False)
        _chat(h, stream=True)
        assert h.scheduler.by_reference is False
        assert h.scheduler.admitted and len(h.scheduler.released) == 2
        # Both generate calls went on the by-value stream view.
        assert h.engine.state.generate_by_reference == [False, False]


class _Handle:
    def __init__(self, accepts: bool) -> None:
        self.accepts = accepts
        self.asked: list[dict[str, Any]] = []

    def options(self, **kwargs: Any) -> Any:
        self.asked.append(kwargs)
        if not self.accepts and "_by_reference" in kwargs:
            raise TypeError("options() got an unexpected keyword argument '_by_reference'")
        return ("view", kwargs)


def test_by_value_asks_for_the_grpc_path_and_keeps_the_handle_where_ray_lacks_it() -> None:
    new = _Handle(accepts=True)
    assert by_value(new) == ("view", {"_by_reference": False})
    old = _Handle(accepts=False)
    assert by_value(old) is old and old.asked == [{"_by_reference": False}]
