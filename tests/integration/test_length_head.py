"""`predictor.engine_head` live: with no Predictor deployment, every
request's length estimate comes from the engine's length head at its first
token (the shipped head for the embedded model), equal to the head applied
to the model's own state at the prompt's last position; a new head is
swapped in by deploying the same config with the Engine deployment's
`user_config` overridden, without restarting the replica or dropping a
stream in flight."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest
import torch

from tests.integration.conftest import PROMPTS, SMALL_CONFIG, _engine_handle

pytestmark = pytest.mark.integration

APP = "head"
ARGS = {
    **SMALL_CONFIG,
    "policy": "econoserve",
    "admission": {"enabled": False},
    "predictor": {"enabled": False, "engine_head": "embedded"},
}


def _deploy(engine_user_config: dict | None) -> None:
    """What `serve deploy config.yaml` sends, waiting until it runs."""
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    app = {"name": APP, "route_prefix": f"/{APP}", "import_path": "app.builder:build_app",
           "args": ARGS}
    if engine_user_config is not None:
        app["deployments"] = [{"name": "Engine", "user_config": engine_user_config}]
    client = serve.context._get_global_client()
    client.deploy_apps(ServeDeploySchema(applications=[app]), _blocking=True)


@pytest.fixture(scope="module")
def head_server(server):
    from ray import serve

    _deploy(None)
    base = f"{server}/{APP}"
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "head app did not come up"
        time.sleep(0.5)
    yield base
    serve.delete(APP)


def body(prompt: str, n: int = 8) -> dict:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}


async def _all(base: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=300) as c:
        rs = await asyncio.gather(*(c.post(f"{base}/v1/completions", json=body(p))
                                    for p in PROMPTS))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json() for r in rs]


def test_every_estimate_comes_from_the_engine_head(head_server):
    from engine.length_head import LengthHead
    from engine.model_source import resolve_model
    from engine.tokenizer import load_tokenizer
    from predictor.fit_head import prompt_states

    got = [r["metrics"]["predicted_output_len"] for r in asyncio.run(_all(head_server))]
    path = resolve_model("embedded:smollm2")
    tok = load_tokenizer(path)
    ids = [list(tok(p)["input_ids"]) for p in PROMPTS]
    want = LengthHead.load("embedded").predict(
        prompt_states(path, ids, log_every=0), torch.tensor([len(i) for i in ids])).tolist()
    for p, g, w in zip(PROMPTS, got, want):
        # float32 on both sides, sums taken in another order.
        assert g is not None and abs(g - w) <= max(1, 0.02 * w), (p, g, w)
    assert len(set(got)) > 1, got


def test_a_new_head_is_swapped_in_without_restarting_the_replica(head_server, tmp_path):
    from engine.length_head import LengthHead

    hidden = LengthHead.load("embedded").hidden_size
    # Every prompt's estimate is 77: nothing but the bias counts.
    flat = LengthHead(torch.zeros(hidden), torch.ones(hidden), torch.zeros(hidden), 0.0,
                      math.log(77.0), 1024)
    flat.save(tmp_path / "flat.pt")
    engine = _engine_handle(APP)
    before = engine.stats.remote().result()
    assert before["length_head"] == "embedded"

    async def stream_while_redeploying() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300) as c:
            req = asyncio.create_task(c.post(f"{head_server}/v1/completions",
                                             json=body(PROMPTS[0], 64)))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(_deploy, {"engine_head": str(tmp_path / "flat.pt")})
            return await req

    r = asyncio.run(stream_while_redeploying())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64
    deadline = time.monotonic() + 120
    while (after := engine.stats.remote().result())["length_head"] != str(tmp_path / "flat.pt"):
        assert time.monotonic() < deadline, after["length_head"]
        time.sleep(0.5)
    assert after["replica"] == before["replica"]
    got = [x["metrics"]["predicted_output_len"] for x in asyncio.run(_all(head_server))]
    assert got == [77] * len(PROMPTS)
