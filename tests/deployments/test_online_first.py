"""The Ingress's door (deployments/online_first.py): online requests start at
once, offline ones a few at a time and never beside a starting online one."""

from __future__ import annotations

import asyncio

import pytest

from deployments.online_first import OnlineFirstDoor


class Starts:
    """Requests that hold the door until released, recording the order in
    which they got in and the most offline ones inside at once."""

    def __init__(self, door: OnlineFirstDoor) -> None:
        self.door = door
        self.entered: list[str] = []
        self.most_offline = 0
        self.online_beside_offline = False
        self.release: dict[str, asyncio.Event] = {}

    async def request(self, name: str, offline: bool) -> None:
        self.release[name] = asyncio.Event()
        async with self.door.start(offline):
            self.entered.append(name)
            self.most_offline = max(self.most_offline, self.door.offline_starting)
            if offline and self.door.online_starting:
                self.online_beside_offline = True
            await self.release[name].wait()

    def spawn(self, name: str, offline: bool) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self.request(name, offline))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_offline_starts_are_bounded_in_arrival_order_and_all_get_in() -> None:
    async def run() -> None:
        s = Starts(OnlineFirstDoor(offline_starts=3))
        tasks = [s.spawn(f"off{i}", True) for i in range(10)]
        await _settle()
        assert s.entered == ["off0", "off1", "off2"]
        assert s.door.offline_waiting == 7
        for i in range(10):
            s.release[f"off{i}"].set()
            await _settle()
        await asyncio.gather(*tasks)
        assert s.entered == [f"off{i}" for i in range(10)]
        assert s.most_offline == 3
        assert (s.door.offline_starting, s.door.offline_waiting) == (0, 0)

    asyncio.run(asyncio.wait_for(run(), 10))


def test_online_never_waits_and_holds_offline_back_while_it_starts() -> None:
    async def run() -> None:
        s = Starts(OnlineFirstDoor(offline_starts=2))
        offline = [s.spawn(f"off{i}", True) for i in range(4)]
        await _settle()
        assert s.entered == ["off0", "off1"]
        online = [s.spawn("on0", False), s.spawn("on1", False)]
        await _settle()
        # Both online requests are in beside the full offline quota.
        assert s.entered == ["off0", "off1", "on0", "on1"]
        # Offline slots that free up stay free while an online request starts.
        s.release["off0"].set()
        s.release["off1"].set()
        await _settle()
        assert s.entered == ["off0", "off1", "on0", "on1"]
        assert s.door.offline_starting == 0
        s.release["on0"].set()
        await _settle()
        assert "off2" not in s.entered
        s.release["on1"].set()
        await _settle()
        assert s.entered[4:] == ["off2", "off3"]
        assert not s.online_beside_offline
        for name in ("off2", "off3"):
            s.release[name].set()
        await asyncio.gather(*offline, *online)
        assert (s.door.online_starting, s.door.offline_starting) == (0, 0)

    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_client_gone_while_waiting_or_just_let_in_hands_its_turn_on() -> None:
    async def run() -> None:
        door = OnlineFirstDoor(offline_starts=1)
        entered: list[str] = []

        async def request(name: str) -> None:
            async with door.start(offline=True):
                entered.append(name)

        async with door.start(offline=True):
            waiting, let_in, last = (asyncio.get_running_loop().create_task(request(n))
                                     for n in ("off1", "off2", "off3"))
            await _settle()
            waiting.cancel()  # hangs up while it waits
            await _settle()
            assert door.offline_waiting == 2
        # Leaving gave off2 its turn (off1's skipped); off2 hangs up before
        # it runs: the turn goes to off3 and no slot leaks.
        assert door.offline_starting == 1
        let_in.cancel()
        await asyncio.gather(waiting, let_in, last, return_exceptions=True)
        assert waiting.cancelled() and let_in.cancelled()
        assert entered == ["off3"]
        assert (door.offline_starting, door.offline_waiting) == (0, 0)

    asyncio.run(asyncio.wait_for(run(), 10))


def test_waiting_offline_requests_go_in_by_priority_then_arrival() -> None:
    async def run() -> None:
        door = OnlineFirstDoor(offline_starts=1)
        entered: list[str] = []

        async def request(name: str, priority: int) -> None:
            async with door.start(offline=True, priority=priority):
                entered.append(name)

        loop = asyncio.get_running_loop()
        async with door.start(offline=True, priority=5):
            tasks = [loop.create_task(request(n, p)) for n, p in
                     (("a", 3), ("b", 0), ("c", 3), ("d", -2), ("e", 0))]
            await _settle()
            assert entered == []
        await asyncio.gather(*tasks)
        assert entered == ["d", "b", "e", "a", "c"]

    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_start_that_fails_frees_its_slot() -> None:
    async def run() -> None:
        door = OnlineFirstDoor(offline_starts=1)
        with pytest.raises(RuntimeError):
            async with door.start(offline=True):
                raise RuntimeError("admission refused")
        with pytest.raises(RuntimeError):
            async with door.start(offline=False):
                raise RuntimeError("tokenizer failed")
        async with door.start(offline=True):
            assert door.offline_starting == 1
        assert (door.online_starting, door.offline_starting) == (0, 0)

    asyncio.run(asyncio.wait_for(run(), 10))


def test_bad_quota_is_refused() -> None:
    with pytest.raises(ValueError, match="offline_starts"):
        OnlineFirstDoor(0)


class _Recorder:
    def __init__(self) -> None:
        self.values: list[float] = []

    def set(self, value: float) -> None:
        self.values.append(value)


def test_the_dashboard_gauges_follow_the_door() -> None:
    from deployments.ingress_metrics import IngressMetrics

    async def run() -> None:
        door = OnlineFirstDoor(offline_starts=2)
        m = IngressMetrics(door)
        m.waiting, m.starting = _Recorder(), _Recorder()  # type: ignore[assignment]
        release = asyncio.Event()

        async def request() -> None:
            async with door.start(offline=True):
                await release.wait()

        tasks = [asyncio.get_running_loop().create_task(request()) for _ in range(5)]
        await _settle()
        m.ensure_running()
        first = m._task
        m.ensure_running()  # one sampler per replica
        assert m._task is first
        await _settle()
        assert (m.waiting.values[-1], m.starting.values[-1]) == (3, 2)
        release.set()
        await asyncio.gather(*tasks)
        m.sample()
        assert (m.waiting.values[-1], m.starting.values[-1]) == (0, 0)
        first.cancel()

    asyncio.run(asyncio.wait_for(run(), 10))
