"""A request's engine stream resumed on another replica when its replica
fails (deployments/resume.py), with fake streams (no Ray cluster)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from api.protocol import GenerateRequest
from deployments.resume import ResumableStream


def gen(n: int = 1) -> GenerateRequest:
    return GenerateRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], max_tokens=6, temperature=0.0, top_p=1.0,
        top_k=-1, seed=None, stop=[], stop_token_ids=[], ignore_eos=True, min_tokens=0,
        n=n, arrival_time=time.time())


class FakeStream:
    """Yields `items`, then raises `error` (if any)."""

    def __init__(self, items: list[list[dict[str, Any]]], error: BaseException | None = None):
        self.items, self.error, self.cancelled = items, error, False

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self._run()

    async def _run(self):  # type: ignore[no-untyped-def]
        for item in self.items:
            yield item
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.cancelled = True


def delta(index: int, tokens: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"prompt": 0, "index": index, "token_ids": tokens, "text": "",
            "finish_reason": finish}


def drain(stream: ResumableStream) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [d async for items in stream for d in items]

    return asyncio.run(run())


def test_a_failed_replica_is_left_for_another_that_goes_on_from_the_clients_tokens():
    died = ActorDiedError()
    first = FakeStream([[delta(0, [10, 11]), delta(1, [20])], [delta(1, [21, 22], "stop")]],
                       died)
    second = FakeStream([[delta(0, [12, 13], "length")]])
    calls: list[tuple[list[GenerateRequest], str | None]] = []

    async def reopen(gens: list[GenerateRequest], failed: str | None) -> tuple[str, Any]:
        calls.append((gens, failed))
        return "replica-b", second

    stream = ResumableStream([gen(n=2)], "replica-a", first, reopen)
    got = drain(stream)
    # Every delta once, in order: nothing lost, nothing repeated.
    assert [d["token_ids"] for d in got] == [[10, 11], [20], [21, 22], [12, 13]]
    (again, failed), = calls
    assert failed == "replica-a" and stream.replica == "replica-b" and stream.resumes == 1
    # Choice 0 goes on from its two tokens; choice 1 had finished.
    assert again[0].resume == [[10, 11], None]
    assert again[0].request_id == "r" and again[0].n == 2


def test_a_refusal_is_not_resumed_and_resumes_are_bounded():
    async def reopen(gens: list[GenerateRequest], failed: str | None) -> tuple[str, Any]:
        return "again", FakeStream([], ActorDiedError())

    refused = ResumableStream([gen()], "a", FakeStream([], ValueError("bad")), reopen)
    with pytest.raises(ValueError, match="bad"):
        drain(refused)
    dying = ResumableStream([gen()], "a", FakeStream([[delta(0, [1])]], ActorDiedError()),
                            reopen, max_resumes=2)
    with pytest.raises(ActorDiedError):
        drain(dying)
    assert dying.resumes == 2


def test_no_replica_to_resume_on_ends_with_the_original_failure():
    async def reopen(gens: list[GenerateRequest], failed: str | None) -> tuple[str, Any]:
        raise RuntimeError("no replica")

    died = ActorDiedError()
    stream = ResumableStream([gen()], "a", FakeStream([], died), reopen)
    with pytest.raises(ActorDiedError) as e:
        drain(stream)
    assert e.value is died


def test_a_replica_that_fails_after_every_choice_finished_changes_nothing():
    async def reopen(gens: list[GenerateRequest], failed: str | None) -> tuple[str, Any]:
        raise AssertionError("not needed")

    stream = ResumableStream([gen()], "a", FakeStream([[delta(0, [1], "stop")]],
                                                      ActorDiedError()), reopen)
    assert [d["token_ids"] for d in drain(stream)] == [[1]]


def test_cancel_reaches_the_current_stream():
    inner = FakeStream([])
    stream = ResumableStream([gen()], "a", inner, None)  # type: ignore[arg-type]
    stream.cancel()
    assert inner.cancelled


def test_a_request_given_back_unstarted_goes_through_the_pool_again_as_it_came():
    from deployments.delivery import JobMoved
    from deployments.resume import MAX_MOVES

    moves: list[tuple[list[GenerateRequest], str | None]] = []

    async def fail(gens: list[GenerateRequest], failed: str | None) -> tuple[str, Any]:
        raise AssertionError("a move is not a failure")

    async def move(gens: list[GenerateRequest], where: str | None) -> tuple[str, Any]:
        moves.append((gens, where))
        return "idle", FakeStream([[delta(0, [5, 6], "length")]])

    original = [gen()]
    stream = ResumableStream(original, "busy", FakeStream([], JobMoved("given back")), fail,
                             move=move)
    assert [d["token_ids"] for d in drain(stream)] == [[5, 6]]
    (again, where), = moves
    assert again is original and where == "busy"
    assert (stream.replica, stream.moves, stream.resumes) == ("idle", 1, 0)

    async def keep_moving(gens: list[GenerateRequest], where: str | None) -> tuple[str, Any]:
        return "x", FakeStream([], JobMoved("again"))

    # Passed around without end: bounded.  Without a mover, the error.
    bouncing = ResumableStream([gen()], "a", FakeStream([], JobMoved("x")), fail,
                               move=keep_moving)
    with pytest.raises(JobMoved):
        drain(bouncing)
    assert bouncing.moves == MAX_MOVES
    with pytest.raises(JobMoved):
        drain(ResumableStream([gen()], "a", FakeStream([], JobMoved("x")), fail))


def test_a_started_request_given_back_goes_on_from_the_clients_tokens():
    """Moved after it streamed (its KV in the host tier): sent to the pool
    with the tokens the client has, so the next replica goes on from there
    without a gap or a duplicate."""
    from deployments.delivery import JobMoved

    moves: list[list[GenerateRequest]] = []

    async def fail(gens: list[GenerateRequest], failed: str | None) -> tuple[str, Any]:
        raise AssertionError("a move is not a failure")

    async def move(gens: list[GenerateRequest], where: str | None) -> tuple[str, Any]:
        moves.append(gens)
        return "idle", FakeStream([[delta(0, [7, 8, 9], "length")]])

    stream = ResumableStream([gen()], "busy",
                             FakeStream([[delta(0, [4])], [delta(0, [5, 6])]],
                                        JobMoved("given back")), fail, move=move)
    assert [d["token_ids"] for d in drain(stream)] == [[4], [5, 6], [7, 8, 9]]
    (again,), = moves
    assert again.resume == [[4, 5, 6]] and again.request_id == "r"
    assert (stream.moves, stream.resumes) == (1, 0)
