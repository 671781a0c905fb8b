"""The engine stream's pacing (deployments/stream_pacing.py), on a fake clock."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from deployments.stream_pacing import HOLD_UNSTREAMED_S, STREAM_LINGER_S, StreamPacer


@dataclass
class D:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def run(pacer: StreamPacer, steps: list[tuple[float, dict[object, int]]],
        end: float | None = None) -> list[tuple[float, dict[object, int]]]:
    """Feed one iteration's tokens per step (choice -> count) at its time;
    the items sent, as (time, tokens by choice)."""
    sent: list[tuple[float, dict[object, int]]] = []
    deltas: dict[object, D] = {}
    for i, (now, tokens) in enumerate(steps):
        last = i == len(steps) - 1 and end is None
        for key, n in tokens.items():
            d = deltas.setdefault(key, D())
            d.token_ids += [7] * n
            if last:
                d.finish_reason = "length"
        if pacer.due(deltas, not last, now):
            sent.append((now, {k: len(d.token_ids) for k, d in deltas.items()}))
            pacer.sent(deltas, now)
            deltas = {}
    return sent


def test_interval_one_sends_every_iteration() -> None:
    p = StreamPacer(True, 1, now=0.0)
    sent = run(p, [(0.1 * i, {0: 1}) for i in range(1, 6)])
    assert [n for _, n in sent] == [{0: 1}] * 5
    assert p.wait_s(1.0) is None


def test_interval_sends_the_first_token_at_once_then_groups_and_the_end() -> None:
    p = StreamPacer(True, 4, now=0.0)
    sent = run(p, [(0.01 * i, {0: 1}) for i in range(1, 11)])
    # 10 tokens: the first alone, then 4, 4, and the last 1 with the end.
    assert [n[0] for _, n in sent] == [1, 4, 4, 1]
    assert sum(n[0] for _, n in sent) == 10


def test_each_choice_gets_its_first_token_at_once() -> None:
    p = StreamPacer(True, 8, now=0.0)
    # Choice 1 starts an iteration later than choice 0 (e.g. n > 1 with a
    # resumed choice): its first token is not held for choice 0's interval.
    sent = run(p, [(0.01, {0: 1}), (0.02, {0: 1, 1: 1}), (0.03, {0: 1, 1: 1})], end=0.1)
    assert sent == [(0.01, {0: 1}), (0.02, {0: 1, 1: 1})]


def test_held_tokens_go_after_the_linger_time() -> None:
    """A job preempted mid-interval: its tokens wait at most STREAM_LINGER_S."""
    p = StreamPacer(True, 16, now=0.0)
    deltas: dict[object, D] = {0: D([1])}
    assert p.due(deltas, True, 0.0)  # the first token
    p.sent(deltas, 0.0)
    assert p.wait_s(0.05) is None  # nothing held: wait for the next delivery
    deltas = {0: D([2, 3])}
    assert not p.due(deltas, True, 0.1)
    assert p.wait_s(0.1) == pytest.approx(STREAM_LINGER_S)
    assert p.wait_s(0.1 + STREAM_LINGER_S / 2) == pytest.approx(STREAM_LINGER_S / 2)
    assert not p.due(deltas, True, 0.1 + STREAM_LINGER_S * 0.9)
    assert p.due(deltas, True, 0.1 + STREAM_LINGER_S)  # the timed-out wait's check
    assert p.wait_s(0.1 + STREAM_LINGER_S) == 0.0


def test_a_delta_without_tokens_is_not_held() -> None:
    p = StreamPacer(True, 4, now=0.0)
    p.sent({0: D([1])}, 0.0)
    assert p.due({0: D([])}, True, 0.01)  # e.g. text or prompt logprobs alone


def test_unstreamed_output_goes_at_most_every_hold_and_at_the_end() -> None:
    p = StreamPacer(False, 4, now=0.0)
    step = HOLD_UNSTREAMED_S / 4
    sent = run(p, [(step * i, {0: 1}) for i in range(1, 11)])
    assert [t for t, _ in sent] == [pytest.approx(HOLD_UNSTREAMED_S),
                                    pytest.approx(2 * HOLD_UNSTREAMED_S),
                                    pytest.approx(10 * step)]
    assert sum(n[0] for _, n in sent) == 10
    assert p.wait_s(3.0) is None  # its client waits for the whole answer anyway


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        StreamPacer(True, 0, now=0.0)


def test_next_items_waits_for_a_delivery_or_the_linger_time() -> None:
    import asyncio
    import time

    async def go() -> None:
        q: asyncio.Queue[int] = asyncio.Queue()
        p = StreamPacer(True, 8, now=time.monotonic())
        q.put_nowait(1)
        q.put_nowait(2)
        assert await p.next_items(q) == [1, 2]  # all it holds, nothing held back
        # Tokens held: an empty queue answers nothing once the linger time is up.
        p.due({0: D([5])}, True, time.monotonic())
        p.sent({0: D([5])}, time.monotonic())
        assert not p.due({0: D([6])}, True, time.monotonic())
        t0 = time.monotonic()
        assert await p.next_items(q) == []
        assert STREAM_LINGER_S * 0.9 <= time.monotonic() - t0 < STREAM_LINGER_S + 5

    asyncio.run(go())
