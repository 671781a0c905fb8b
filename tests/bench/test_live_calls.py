"""`bench trace-live` / `profile-live`: each call to the engine replica is
bounded, and a call that gets no answer exits with what to check instead of
hanging (a driver whose RAY_AUTH_MODE differs from the cluster's never gets
the answers to its actor-task calls)."""

from __future__ import annotations

import argparse

import pytest

from bench.cli_profile import add_call_args, answer
from bench.cli_trace import add_trace_parsers


class _Response:
    def __init__(self, value: object = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self.timeouts: list[float] = []

    def result(self, timeout_s: float) -> object:
        self.timeouts.append(timeout_s)
        if self.error is not None:
            raise self.error
        return self.value


def test_an_answer_in_time_is_returned_and_the_bound_passed_on():
    r = _Response({"plans": []})
    assert answer(r, "Engine.step_trace", 7.5) == {"plans": []}
    assert r.timeouts == [7.5]


def test_no_answer_exits_naming_the_call_and_the_auth_mode(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(SystemExit) as e:
        answer(_Response(error=TimeoutError("Timed out resolving to ObjectRef.")),
               "Engine.stats", 3.0)
    msg = str(e.value)
    assert "Engine.stats" in msg and "3 s" in msg
    assert "RAY_AUTH_MODE" in msg and "token" in msg and "--call-timeout" in msg


def test_other_errors_are_not_taken_for_a_timeout():
    with pytest.raises(RuntimeError):
        answer(_Response(error=RuntimeError("replica died")), "Engine.stats", 3.0)


def test_the_live_commands_take_the_bound():
    q = argparse.ArgumentParser()
    add_call_args(q)
    a = q.parse_args(["--call-timeout", "30"])
    assert (a.call_timeout, a.address, a.app) == (30.0, "auto", "llm")
    assert q.parse_args([]).call_timeout == 120.0

    p = argparse.ArgumentParser()
    add_trace_parsers(p.add_subparsers())
    assert p.parse_args(["trace-live", "--out", "t.json.gz", "--call-timeout", "5"]).call_timeout \
        == 5.0
