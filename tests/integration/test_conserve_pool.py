"""The cluster-level offline pool live: `policy: conserve` with two engine
replicas.  A burst of offline requests larger than both replicas' room
waits in the Scheduler deployment (its stats show it) while each replica
holds its free batch slots and its queue's worth; both replicas get work;
a client that gives up while its request waits in the pool takes it out;
every answer is the one the FCFS application gives the same prompt.  A
replica busy with online work gives back the offline requests it holds
waiting when the other has room, started ones through the host tier.  Then
the Scheduler replica is killed under waiting requests: their clients get
a 503, and once Serve has restarted it, offline requests are served again.

Named to run right after test_conserve.py, whose application it replaces:
the session's Ray has room for three 1-CPU engine bundles at a time (the
default application's and these two), and the MLFQ and admission modules
after it add theirs for the rest of the session."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.integration.conftest import SMALL_CONFIG, _deploy, reference_texts

pytestmark = pytest.mark.integration

APP = "pool"
POOL_CONFIG = {
    **SMALL_CONFIG,
    "policy": "conserve",
    "num_engine_replicas": 2,
    "max_batch_size": 4,
    # Room per idle replica: 2 batch slots + a queue of 1.  Objectives no
    # iteration meets: no offline token joins online work on a replica.
    # Every full block of an offline job checkpointed to the host tier.
    "conserve": {"offline_max_batch_size": 2, "ttft_slo_s": 1e-6, "tpot_slo_s": 1e-6,
                 "checkpoint_threshold": 0.0},
    "host_kv_tokens": 4096,
    # A fixed queue of 1, whatever the replica's intake: the bound below.
    "offline_pool": {"replica_queue_jobs": 1, "queue_per_start": 0},
}
PROMPTS = [f"Write a short poem about a {thing}." for thing in
           ("cat", "ship", "mountain", "clock", "garden")]
REQUESTS = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def pool_server(server):
    from ray import serve

    yield _deploy(server, APP, POOL_CONFIG)
    serve.delete(APP)


@pytest.fixture(scope="module")
def scheduler(pool_server):
    from ray import serve

    return serve.get_deployment_handle("Scheduler", app_name=APP)


def body(prompt: str, priority: int = 0) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "job_class": "offline", "priority": priority}


class Poller:
    """Samples `Scheduler.stats()` on a thread while the requests run."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append(self.handle.stats.remote().result(timeout_s=10))
            except Exception:  # the Scheduler restarting (second test)
                pass
            time.sleep(0.1)

    def __enter__(self) -> "Poller":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(15)


async def _burst(base: str, waiting: Callable[[], bool]) -> tuple[list[dict], int]:
    """The burst, and one more request whose client gives up while it waits
    in the pool; returns the burst's answers and that request's status (0:
    the client gave up)."""
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(prompt: str) -> dict:
            r = await c.post(f"{base}/v1/completions", json=body(prompt))
            assert r.status_code == 200, r.text
            return r.json()

        burst = [asyncio.create_task(one(p)) for p in REQUESTS]
        # Wait until requests are held in the pool, then send one behind them
        # (last in line: a larger priority value) and hang up after a second.
        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(waiting):
            assert time.monotonic() < deadline, "no request was ever held in the pool"
            await asyncio.sleep(0.2)
        try:
            r = await c.post(f"{base}/v1/completions", json=body("Count to ten.", priority=10),
                             timeout=1.0)
            given_up = r.status_code
        except httpx.TimeoutException:
            given_up = 0
        return await asyncio.gather(*burst), given_up


def _engine_stats(app: str) -> dict[str, dict]:
    """`Engine.stats()` of each replica (calls land on either)."""
    from ray import serve

    handle = serve.get_deployment_handle("Engine", app_name=app)
    seen: dict[str, dict] = {}
    for _ in range(60):
        s = handle.stats.remote().result()
        seen[s["replica"]] = s
        if len(seen) == 2:
            break
    return seen


def _wait_idle(scheduler, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = scheduler.stats.remote().result()
        reps = st["offline_pool"]["replicas"]
        if st["active_jobs"] == 0 and st["offline_pool"]["waiting"] == 0 and all(
                r["running_jobs"] == 0 and r["queued_jobs"] == 0 for r in reps.values()):
            return st
        assert time.monotonic() < deadline, f"the application did not go idle: {st}"
        time.sleep(0.2)


def test_offline_requests_wait_in_the_scheduler_and_flow_to_both_replicas(
        server, pool_server, scheduler):
    def held() -> bool:
        return scheduler.stats.remote().result()["offline_pool"]["waiting"] > 0

    with Poller(scheduler) as poll:
        answers, given_up = asyncio.run(_burst(pool_server, held))
        final = _wait_idle(scheduler)
    assert given_up == 0  # the client hung up while its request waited
    pools = [s["offline_pool"] for s in poll.samples]
    # Held in the Scheduler while both replicas were at their room: the
    # burst of 12 exceeds 2 x (2 slots + 1 queued).
    full = [p for p in pools if p["waiting"] > 0 and len(p["replicas"]) == 2
            and all(r["room"] <= 0 for r in p["replicas"].values())]
    assert full, pools[-5:]
    assert max(p["waiting"] for p in pools) >= 6
    # A replica never held more offline jobs than its room allows.
    over = [(rid, r) for p in pools for rid, r in p["replicas"].items()
            if r["queued_jobs"] + r["running_jobs"] > 3]
    assert not over, over[:5]
    pool = final["offline_pool"]
    assert pool["handed_out"] == len(REQUESTS) and pool["cancelled"] == 1
    assert final["outcomes"].get("finished") == len(REQUESTS)
    engines = _engine_stats(APP)
    assert len(engines) == 2
    offline = [s["tokens_by_class"].get("offline", 0) for s in engines.values()]
    # Both replicas served offline work; the request given up never ran.
    assert all(t > 0 for t in offline) and sum(offline) == MAX_TOKENS * len(REQUESTS)
    refs = dict(zip(PROMPTS, reference_texts(server, [
        {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        for p in PROMPTS])))
    for p, got in zip(REQUESTS, answers):
        assert got["choices"][0]["text"] == refs[p], p


# In the long run (-m slow), as its split-model twin: 192-token answers on two
# replicas, a minute of a default run that must stay short.  The default run
# keeps the pool live (the tests beside it); the moves themselves are
# tests/scheduler/test_offline_pool.py's and test_engine_loop_offline.py's.
@pytest.mark.slow
def test_offline_work_waiting_on_a_replica_busy_with_online_work_moves_to_one_with_room(
        server, pool_server, scheduler):
    """Offline requests fill both replicas (2 running + 1 queued each);
    then a long online request takes one of them, where no offline token
    may join it: its offline jobs wait, the running ones with their full
    blocks checkpointed.  Once the other replica has run out of offline
    work (the pool is empty), the busy one gives back what it holds: the
    queued ones as they came, the started ones with the tokens their
    clients have, resumed on the other replica.  Every answer is whole and
    the FCFS application's."""
    check_moves(server, pool_server, scheduler, APP)


def check_moves(server: str, pool_server: str, scheduler, app: str) -> None:
    """The scenario above on application `app` (URL `pool_server`, its
    Scheduler's handle `scheduler`), answers checked against the default
    application at `server`."""
    before = scheduler.stats.remote().result()
    offline_before = {k: s["tokens_by_class"].get("offline", 0)
                      for k, s in _engine_stats(app).items()}
    prompts = REQUESTS[:6]
    # Long enough that the busy replica's started jobs are still running when
    # the online request lands there (at 64 a fast CPU finished them first,
    # and at 128 a loaded one, under the whole suite, once in four runs: only
    # queued ones moved).
    max_tokens = 192

    async def run() -> tuple[list[dict], bool]:
        async with httpx.AsyncClient(timeout=600) as c:
            async def one(prompt: str) -> dict:
                r = await c.post(f"{pool_server}/v1/completions",
                                 json={**body(prompt), "max_tokens": max_tokens})
                assert r.status_code == 200, r.text
                return r.json()

            offline = [asyncio.create_task(one(p)) for p in prompts]
            # Both replicas' offline jobs have a full block checkpointed (16
            # tokens each of their two, past prompts of under 16 tokens)
            # before the online request.
            deadline = time.monotonic() + 120
            while sum(s["tokens_by_class"].get("offline", 0) - offline_before.get(k, 0) >= 32
                      for k, s in (await asyncio.to_thread(_engine_stats, app)).items()) < 2:
                assert time.monotonic() < deadline, "offline work never ran on both replicas"
                await asyncio.sleep(0.1)
            online = asyncio.create_task(c.post(f"{pool_server}/v1/completions", json={
                # Outlasts the offline answers (it is cancelled after them).
                "prompt": "Tell me a long story.", "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True}))
            answers = await asyncio.gather(*offline)
            # Still streaming: it is not waited for (its client hangs up).
            still_online = not online.done()
            online.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await online
            return answers, still_online

    answers, still_online = asyncio.run(run())
    after = _wait_idle(scheduler)
    assert still_online  # the busy replica never left its online work
    moved = after["moved"] - before["moved"]
    assert moved >= 1, after
    assert after["resumed"] == before["resumed"]  # no replica failed
    engines = _engine_stats(app)
    assert sum(s["offline_given_back"] for s in engines.values()) >= moved
    # A started request went on elsewhere from the tokens its client had
    # (its KV fetched from the host tier where its blocks were copied,
    # tests/scheduler/test_checkpoint.py; the rest recomputed).
    resumed = [s["resumed"] for s in engines.values()]
    assert sum(r["jobs"] for r in resumed) >= 1, resumed
    assert sum(r["tokens_fetched"] for r in resumed) >= 16, resumed
    distinct = sorted(set(prompts))
    refs = dict(zip(distinct, reference_texts(server, [
        {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        for p in distinct])))
    for p, got in zip(prompts, answers):
        # No gap, no duplicate: the whole answer, and the uninterrupted one.
        assert got["usage"]["completion_tokens"] == max_tokens, got["usage"]
        assert got["choices"][0]["text"] == refs[p], p


def _kill_scheduler() -> None:
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if f"{APP}#Scheduler#" in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]),
             no_restart=True)


def test_a_scheduler_restart_answers_waiting_requests_503(pool_server, scheduler):
    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as c:
            async def one(prompt: str) -> int:
                r = await c.post(f"{pool_server}/v1/completions", json=body(prompt))
                assert r.status_code in (200, 503), r.text
                if r.status_code == 503:
                    assert r.json()["error"]["type"] == "service_unavailable", r.text
                return r.status_code

            tasks = [asyncio.create_task(one(p)) for p in REQUESTS]
            deadline = time.monotonic() + 120
            while not await asyncio.to_thread(
                    lambda: scheduler.stats.remote().result()["offline_pool"]["waiting"] > 0):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            await asyncio.to_thread(_kill_scheduler)
            return await asyncio.gather(*tasks)

    codes = asyncio.run(run())
    # Those handed out before the kill finish on their engines; those that
    # waited in the pool fail with it.
    assert 503 in codes and 200 in codes, codes
    # Serve restarts the Scheduler; the engines report to the new one, whose
    # pool serves offline requests again.
    deadline = time.monotonic() + 120
    while True:
        try:
            st = scheduler.stats.remote().result(timeout_s=10)
            if len(st["offline_pool"]["replicas"]) == 2:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the Scheduler did not come back"
        time.sleep(0.5)
    r = httpx.post(f"{pool_server}/v1/completions", timeout=300, json=body(PROMPTS[0]))
    assert r.status_code == 200, r.text
