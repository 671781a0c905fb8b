"""An online request sent to its engine replica beside its admission call
(deployments/dispatch_ahead.py): only where the last answer foresaw the
replica, one at a time, kept when admitted there and cancelled otherwise."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from api.admission_wire import Admission
from deployments.dispatch_ahead import DispatchAhead


class Call:
    def __init__(self, replica: str | None, fresh: bool) -> None:
        self.replica, self.fresh, self.cancelled = replica, fresh, False

    def cancel(self) -> None:
        self.cancelled = True


class Refused(Exception):
    pass


def _run(ahead: DispatchAhead, answer: str | None | type[Exception], online: bool = True,
         gate: asyncio.Event | None = None) -> tuple[list[str], list[Call], Any]:
    """Open a request whose admission answers `answer` (a replica, or an
    exception raised); the order of events and the calls sent."""
    events: list[str] = []
    calls: list[Call] = []

    async def admit() -> str | None:
        events.append("admit asked")
        if gate is not None:
            await gate.wait()
        events.append("admit answered")
        if isinstance(answer, type):
            raise answer()
        return answer

    def send(replica: str | None, fresh: bool) -> Call:
        events.append(f"sent to {replica}")
        calls.append(Call(replica, fresh))
        return calls[-1]

    async def go() -> Any:
        return await ahead.open(online, admit, send)

    try:
        result = asyncio.run(go())
    except Refused as e:
        result = e
    return events, calls, result


def _foreseeing(replica: str = "r1") -> DispatchAhead:
    ahead = DispatchAhead()
    ahead.learn(Admission(admitted=True, replica=replica, dispatch_ahead=replica))
    return ahead


def test_without_a_foreseen_replica_the_stream_opens_after_the_answer() -> None:
    events, calls, (replica, call) = _run(DispatchAhead(), "r1")
    assert events == ["admit asked", "admit answered", "sent to r1"]
    assert replica == "r1" and call is calls[0] and not call.cancelled and not call.fresh


def test_a_foreseen_replica_gets_the_request_before_the_answer_and_keeps_it() -> None:
    ahead = _foreseeing()
    events, calls, (replica, call) = _run(ahead, "r1")
    assert events == ["sent to r1", "admit asked", "admit answered"]
    assert replica == "r1" and call is calls[0] and len(calls) == 1 and not call.cancelled
    assert (ahead.num_kept, ahead.num_cancelled) == (1, 0)


def test_a_refusal_cancels_the_early_stream_and_turns_the_guess_off() -> None:
    ahead = _foreseeing()
    events, calls, result = _run(ahead, Refused)
    assert isinstance(result, Refused) and len(calls) == 1 and calls[0].cancelled
    assert ahead.num_cancelled == 1
    # The ingress learns the refusal's answer: the next request waits for its own.
    ahead.learn(Admission(admitted=False, retry_after_s=1.0))
    events, calls, _ = _run(ahead, "r1")
    assert events == ["admit asked", "admit answered", "sent to r1"]


def test_admitted_elsewhere_the_early_stream_is_cancelled_and_sent_again_fresh() -> None:
    ahead = _foreseeing("r1")
    events, calls, (replica, call) = _run(ahead, "r2")
    assert events == ["sent to r1", "admit asked", "admit answered", "sent to r2"]
    assert calls[0].cancelled and replica == "r2" and call is calls[1]
    assert call.fresh and not call.cancelled


@pytest.mark.parametrize("case", ["offline", "disabled", "answer_without_guess"])
def test_no_early_stream(case: str) -> None:
    ahead = DispatchAhead(enabled=case != "disabled")
    ahead.learn(Admission(admitted=True, replica="r1",
                          dispatch_ahead=None if case == "answer_without_guess" else "r1"))
    events, _, _ = _run(ahead, "r1", online=case != "offline")
    assert events[0] == "admit asked"


def test_one_early_stream_at_a_time() -> None:
    ahead = _foreseeing()
    gate = asyncio.Event()
    log: list[str] = []

    async def go() -> None:
        async def admit() -> str:
            await gate.wait()
            return "r1"

        def send(replica: str | None, fresh: bool) -> Call:
            return Call(replica, fresh)

        first = asyncio.ensure_future(ahead.open(True, admit, send))
        await asyncio.sleep(0)
        # While the first is claimed, the next waits for its own answer.
        assert ahead.claim(True) is None
        gate.set()
        await first
        log.append("first done")
        assert ahead.claim(True) == "r1"

    asyncio.run(go())
    assert log == ["first done"]


def test_a_client_gone_during_the_admission_cancels_the_early_stream() -> None:
    ahead = _foreseeing()
    calls: list[Call] = []

    async def go() -> None:
        async def admit() -> str:
            await asyncio.sleep(10)
            return "r1"

        def send(replica: str | None, fresh: bool) -> Call:
            calls.append(Call(replica, fresh))
            return calls[-1]

        task = asyncio.ensure_future(ahead.open(True, admit, send))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert len(calls) == 1 and calls[0].cancelled
    assert ahead.claim(True) == "r1"  # the claim was freed


class _Counter:
    def __init__(self) -> None:
        self.counts: dict[str, float] = {}

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.counts[tags["outcome"]] = self.counts.get(tags["outcome"], 0) + value


def test_the_dashboard_counts_kept_and_cancelled_once() -> None:
    from deployments.ingress_metrics import IngressMetrics
    from deployments.online_first import OnlineFirstDoor

    ahead = _foreseeing()
    m = IngressMetrics(OnlineFirstDoor(offline_starts=2), ahead)
    m.dispatched_ahead = _Counter()  # type: ignore[assignment]
    for answer in ("r1", "r1", "r2"):
        _run(ahead, answer)
        ahead.learn(Admission(admitted=True, replica="r1", dispatch_ahead="r1"))
    m.sample()
    _run(ahead, Refused)
    m.sample()
    m.sample()  # nothing new
    assert m.dispatched_ahead.counts == {"kept": 2, "cancelled": 2}
