"""Start the real Ray Serve application once for the integration tests."""

from __future__ import annotations

import os
import socket
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Eight chat prompts of a few dozen tokens each, for the policy tests.
PROMPTS = [
    "Write a short poem about the ocean.",
    "List five fruits and their colors.",
    "Explain what a CPU does in one paragraph.",
    "Describe a sunny day at the beach.",
    "Give three tips for learning to cook.",
    "What is the tallest mountain on Earth?",
    "Name the planets of the solar system.",
    "Summarize the plot of Romeo and Juliet.",
]

# float32, not `auto`: the tests compare greedy outputs of runs with
# different batch compositions (FCFS vs MLFQ with swaps, one request vs
# many), and bf16 rounds differently with the batch, so on a CPU with
# native bf16 (where `auto` means bfloat16) greedy text diverges.
SMALL_CONFIG = {
    "model": "embedded:smollm2",
    "dtype": "float32",
    "block_size": 16,
    "kv_cache_tokens": 4096,
    "max_batch_size": 16,
    "max_batch_tokens": 256,
    "max_model_len": 1024,
}


# The iteration cost the default application's engine timed when it started
# (engine/profiler.py), pinned in the config of every application deployed
# after it (`iteration_cost`): their engine replicas, all on the same model,
# dtype and threads, then start without timing the model again (about 5 s of
# each start on a 2-core machine, more where two replicas start at once).
PINNED_COST: dict[str, float] = {}


def with_pinned_cost(config: dict) -> dict:
    return {"iteration_cost": dict(PINNED_COST), **config} if PINNED_COST else config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(ray_session):
    import httpx
    from ray import serve

    from app.builder import build_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(SMALL_CONFIG), name="llm", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.5)
    engine = serve.get_deployment_handle("Engine", app_name="llm").stats.remote().result()
    assert engine["engine"]["iteration_cost_source"] == "timed", engine["engine"]
    PINNED_COST.update(engine["engine"]["iteration_cost"])
    yield base
    serve.shutdown()


MLFQ_CONFIG = {
    **SMALL_CONFIG,
    "policy": "mlfq",
    "swap_mode": "proactive",
    # 32 device blocks and 4 batch slots for 8 jobs of ~5 blocks each:
    # idle jobs must make room, by swapping.
    "kv_cache_tokens": 512,
    "max_batch_size": 4,
    "max_model_len": 512,
    "host_kv_tokens": 16384,
    "mlfq": {"starvation_s": 2.0},
    # The burst is meant to overflow the cache and force swaps, not to be
    # refused by admission control.
    "admission": {"enabled": False},
    # The length predictor beside it, with the shipped adapter.
    "predictor": {"enabled": True, "num_cpus": 0.5},
}


def _engine_handle(app: str):
    from ray import serve

    return serve.get_deployment_handle("Engine", app_name=app)


def _deploy(server: str, name: str, config: dict) -> str:
    """Run one more application on /<name> beside the default one; its URL
    once its /health answers."""
    from ray import serve

    from app.builder import build_app

    serve.run(build_app(with_pinned_cost(config)), name=name, route_prefix=f"/{name}")
    return _healthy(server, name)


def _healthy(server: str, name: str) -> str:
    import httpx

    base = f"{server}/{name}"
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, f"{name} app did not come up"
        time.sleep(0.5)
    return base


def deploy_declared(name: str, config: dict, deployments: list[dict] | None = None) -> None:
    """Deploy application `name` through Serve's declarative API, as `serve
    deploy config.yaml` does (so that a later call with other deployment
    options, e.g. a `user_config`, updates it in place), waiting until it runs."""
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    app = {"name": name, "route_prefix": f"/{name}", "import_path": "app.builder:build_app",
           "args": with_pinned_cost(config)}
    if deployments:
        app["deployments"] = deployments
    client = serve.context._get_global_client()
    client.deploy_apps(ServeDeploySchema(applications=[app]), _blocking=True)


@pytest.fixture(scope="module")
def declared_server(server, request):
    """A module's declared application (`deploy_declared`): the module's APP
    and ARGS; its URL."""
    from ray import serve

    name, config = request.module.APP, request.module.ARGS
    deploy_declared(name, config)
    yield _healthy(server, name)
    serve.delete(name)


async def post_all(base: str, bodies: list[dict]) -> list[dict]:
    """POST every body to /v1/completions at once; each answer's JSON (all 200)."""
    import asyncio

    import httpx

    async with httpx.AsyncClient(timeout=300) as c:
        rs = await asyncio.gather(*(c.post(f"{base}/v1/completions", json=b) for b in bodies))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json() for r in rs]


# Reference answers already asked this session, by server and request body.
_REFERENCES: dict[tuple[str, str], dict] = {}


def references(server: str, bodies: list[dict]) -> list[dict]:
    """The default (FCFS) application's answers to `bodies` (float32,
    greedy), each asked once a session: the bodies not asked yet go
    together in one burst, and several tests compare against the same
    prompts at the same lengths."""
    import asyncio
    import json

    keys = [(server, json.dumps(b, sort_keys=True)) for b in bodies]
    missing = [k for k in dict.fromkeys(keys) if k not in _REFERENCES]
    if missing:
        answers = asyncio.run(post_all(server, [json.loads(k[1]) for k in missing]))
        _REFERENCES.update(zip(missing, answers))
    return [_REFERENCES[k] for k in keys]


def reference_texts(server: str, bodies: list[dict]) -> list[str]:
    return [r["choices"][0]["text"] for r in references(server, bodies)]


@pytest.fixture(scope="session")
def mlfq_server(server):
    """A second application, MLFQ with proactive swapping, on /mlfq."""
    yield _deploy(server, "mlfq", MLFQ_CONFIG)


@pytest.fixture(scope="session")
def mlfq_engine(mlfq_server):
    return _engine_handle("mlfq")


@pytest.fixture(scope="session")
def engine_handle(server):
    return _engine_handle("llm")


def wait_engine_idle(handle, timeout: float = 30.0) -> dict:
    """Poll until no job holds a block; returns the engine's stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = handle.stats.remote().result()
        if s["free_blocks"] == s["num_blocks"] and s["open_streams"] == 0 \
                and s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"engine did not go idle: {s}"
        time.sleep(0.2)


TIGHT_CONFIG = {
    **SMALL_CONFIG,
    # Two batch slots and a bound of 200 queued tokens: a burst of 16
    # requests of ~45 tokens each must be partly refused.
    "max_batch_size": 2,
    "admission": {"max_queued_tokens": 200},
}


@pytest.fixture(scope="session")
def tight_server(server):
    """A third application with a tight admission bound, on /tight."""
    yield _deploy(server, "tight", TIGHT_CONFIG)


@pytest.fixture(scope="session")
def tight_engine(tight_server):
    return _engine_handle("tight")


CONSERVE_CONFIG = {
    **SMALL_CONFIG,
    "policy": "conserve",
    "max_batch_size": 6,
    # A bound that online requests would hit; offline ones are outside it.
    "admission": {"max_queued_tokens": 64},
    # 20 blocks (the start-up profiler's 256-token prefill needs 16) for 6
    # running offline requests of up to 4 blocks each: growing ones evict
    # others, which the host tier holds checkpoints of (ConServe §4.4)
    # from the first block in use.
    "kv_cache_tokens": 320,
    "max_model_len": 320,
    "host_kv_tokens": 4096,
    # A TTFT objective that no offline pass leaves room for: every online
    # arrival cuts the pass under way (Algorithm 2 would let a short one end).
    "conserve": {"checkpoint_threshold": 0.0, "ttft_slo_s": 0.02},
}


@pytest.fixture(scope="module")
def conserve_server(server):
    """Online/offline co-serving, on /conserve, for one module: the test
    session's Ray has room for three 1-CPU engine bundles at a time."""
    from ray import serve

    yield _deploy(server, "conserve", CONSERVE_CONFIG)
    serve.delete("conserve")


@pytest.fixture(scope="module")
def conserve_engine(conserve_server):
    return _engine_handle("conserve")
