"""The Scheduler deployment's offline pool wiring, without Ray: the
undecorated class, its Serve context faked, driven on one asyncio loop as
Serve drives it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from api.config import AppConfig
from scheduler.offline_pool import OfflineLoad

CONSERVE = {"policy": "conserve", "offline_pool": {"replica_queue_jobs": 1}}


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch):
    import deployments.scheduler as mod

    monkeypatch.setattr(mod.serve, "get_replica_context",
                        lambda: SimpleNamespace(app_name="test"))
    stopped: list[str] = []

    class _Stop:
        def remote(self, reason: str, replica: str | None = None) -> Any:
            async def stop() -> int:
                stopped.append(replica or "")
                return 0
            return stop()

    monkeypatch.setattr(mod.serve, "get_deployment_handle",
                        lambda name, app: SimpleNamespace(stop_serving=_Stop()))

    def build(config: dict[str, Any]) -> Any:
        return mod.Scheduler.func_or_class(config)

    build.stopped = stopped  # type: ignore[attr-defined]
    return build


async def report(s: Any, rid: str, load: OfflineLoad, free_blocks: int = 100) -> None:
    await s.report_load(rid, 100, free_blocks, 0, 0,
                        {"waiting_tokens": 0, "capacity_tokens": 1e9, "tokens_per_s": 100.0},
                        offline=load.to_wire())


def admit(s: Any, rid: str, job_class: str = "offline", priority: int = 0) -> asyncio.Task:
    return asyncio.ensure_future(s.admit(rid, 20, 40, job_class, 1, priority=priority))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_offline_admits_wait_in_the_pool_and_go_to_the_idle_replica(make) -> None:
    async def run() -> None:
        s = make(CONSERVE)
        first = admit(s, "o1")
        await settle()
        assert not first.done()  # no replica has reported yet
        assert s.pool is not None and "o1" in s.pool
        await report(s, "idle", OfflineLoad(free_slots=1))
        await report(s, "busy", OfflineLoad(online_tokens=5000))
        assert (await first)["replica"] == "idle"
        rest = [admit(s, f"o{i}") for i in range(2, 6)]
        await settle()
        # "idle" takes a second (its queue of 1), then "busy" its queue's
        # worth; the other two wait, and the stats say so.
        assert [t.result()["replica"] for t in rest[:2]] == ["idle", "busy"]
        assert not any(t.done() for t in rest[2:])
        st = await s.stats()
        pool = st["offline_pool"]
        assert pool["waiting"] == 2
        assert {r: v["room"] for r, v in pool["replicas"].items()} == {"idle": 0, "busy": 0}
        assert pool["replicas"]["idle"]["assigned_jobs"] == 2
        # An online request does not wait behind them.
        online = await s.admit("on", 20, 40, "online", 1)
        assert online["admitted"] and online["replica"] in {"idle", "busy"}
        # Capacity appears: the waiting requests flow.
        await report(s, "idle", OfflineLoad(free_slots=4))
        await settle()
        assert all(t.done() for t in rest)
        assert (await s.stats())["offline_pool"]["waiting"] == 0
    asyncio.run(run())


def test_a_cancelled_admit_leaves_the_pool(make) -> None:
    async def run() -> None:
        s = make(CONSERVE)
        await report(s, "r", OfflineLoad(queued_jobs=1))  # full
        waiting = admit(s, "gone")
        await settle()
        waiting.cancel()  # what Serve does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await waiting
        st = (await s.stats())["offline_pool"]
        assert st["waiting"] == 0 and st["cancelled"] == 1 and st["handed_out"] == 0
        assert not s._pooled and "gone" not in s.jobs
        # Room appears: nothing is handed out for the cancelled request.
        await report(s, "r", OfflineLoad())
        assert (await s.stats())["offline_pool"]["handed_out"] == 0
    asyncio.run(run())


def test_cancelled_after_its_hand_out_the_room_comes_back(make) -> None:
    async def run() -> None:
        s = make(CONSERVE)
        await report(s, "r", OfflineLoad())
        a = admit(s, "a")
        await settle()
        b = admit(s, "b")
        await settle()
        assert a.done() and not b.done()  # "a" holds r's only place
        # "a" handed out, its client gone before it reached the replica;
        # its release frees the place at once.
        await s.release("a", "aborted")
        await settle()
        assert (await b)["replica"] == "r"
    asyncio.run(run())


def test_priority_orders_the_pool(make) -> None:
    async def run() -> None:
        s = make(CONSERVE)
        await report(s, "r", OfflineLoad(queued_jobs=1))
        tasks = {rid: admit(s, rid, priority=p) for rid, p in (("low", 2), ("high", -1))}
        await settle()
        await report(s, "r", OfflineLoad())
        await settle()
        assert tasks["high"].done() and not tasks["low"].done()
        tasks["low"].cancel()
    asyncio.run(run())


def test_shutdown_lets_waiting_requests_go_on_to_the_stopped_engines(make) -> None:
    async def run() -> None:
        s = make(CONSERVE)
        await report(s, "r", OfflineLoad(queued_jobs=1))
        waiting = admit(s, "w")
        await settle()
        await s.shutdown_engines("bye")
        assert make.stopped == ["r"]
        # Any replica: each refuses it with the shutdown's reason (a 503).
        assert (await waiting) == {"admitted": True, "replica": None, "retry_after_s": None,
                                   "message": None, "dispatch_ahead": None}
        late = await s.admit("late", 20, 40, "offline", 1)
        assert late["admitted"] and (await s.stats())["offline_pool"]["waiting"] == 0
    asyncio.run(run())


def test_no_pool_outside_conserve_or_when_disabled(make) -> None:
    async def run() -> None:
        for cfg in ({"policy": "fcfs"},
                    {"policy": "conserve", "offline_pool": {"enabled": False}}):
            s = make(cfg)
            assert s.pool is None
            await report(s, "r", OfflineLoad(queued_jobs=100))
            assert (await s.admit("x", 20, 40, "offline", 1))["replica"] == "r"
            assert (await s.stats())["offline_pool"] is None
    asyncio.run(run())


def test_a_bad_pool_config_names_the_field() -> None:
    with pytest.raises(ValidationError, match="offline_pool.replica_queue_jobs"):
        AppConfig(offline_pool={"replica_queue_jobs": 0})


def test_a_replicas_load_report_drives_the_ttft_estimate_through_the_scheduler(make) -> None:
    # What the Engine replica sends (scheduler.admission.load_report) is
    # what the Scheduler deployment's placement reads: a mismatch would
    # fail every report and leave admission on stale figures.
    from scheduler.admission import AdmissionBound, load_report
    from scheduler.cost import LinearCost
    from scheduler.job import Job

    async def run() -> None:
        s = make({})
        cost = LinearCost(0.1, 0.01, 0.02)
        bound = AdmissionBound(ttft_slo_s=2.0)
        decoding = Job("d", [1] * 10, max_tokens=50, arrival_time=0.0)
        decoding.output_token_ids = [3]
        decoding.num_computed_tokens = 10
        report = load_report([decoding], {"d"}, 50.0, 100.0, bound, 8, 100, cost)
        await s.report_load("r", 100, 90, 0, 1, report)
        st = (await s.stats())["replicas"]["r"]
        assert st["prefill"]["decodes"] == 1 and st["prefill"]["base_s"] == 0.1
        # 150 prompt tokens: 2 steps at 0.12 s and one under way, 1.5 s of
        # tokens: 1.86 s, admitted; a second one would wait past 2 s.
        first = await s.admit("a", 150, 10, "online", 1)
        assert first["admitted"] and first["replica"] == "r"
        second = await s.admit("b", 150, 10, "online", 1)
        assert not second["admitted"] and second["retry_after_s"] >= 0.5
        # A fixed bound reports no estimate: the token bound decides.
        fixed = load_report([decoding], {"d"}, 50.0, 100.0,
                            AdmissionBound(2.0, max_queued_tokens=64), 8, 100, cost)
        assert "prefill" not in fixed and fixed["capacity_tokens"] == 64.0

    asyncio.run(run())


def test_ready_counts_the_engine_replicas_that_report(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import deployments.scheduler as mod

    s = make({"num_engine_replicas": 2})
    now = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])

    async def go() -> list[dict[str, int]]:
        seen = [await s.ready()]  # started: no engine has loaded its model yet
        await report(s, "a", OfflineLoad())
        seen.append(await s.ready())
        now[0] += 5.0
        await report(s, "b", OfflineLoad())
        seen.append(await s.ready())
        now[0] += s.placement.stale_after_s + 1  # both fall silent (died)
        seen.append(await s.ready())
        return seen

    counts = [r["live_engines"] for r in asyncio.run(go())]
    assert counts == [0, 1, 2, 0]
