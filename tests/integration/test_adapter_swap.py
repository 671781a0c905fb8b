"""A new predictor adapter swapped into a running application, as a user
does it: the same Serve config deployed again with the Predictor
deployment's `user_config` overridden (README, "Length predictor").  Serve
then reconfigures the running Predictor replicas in place (`reconfigure`);
the Ingress, Scheduler and Engine keep their replicas, so a stream in
flight meanwhile completes.  Changing the application's `args` instead
would rebuild the whole application."""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import SMALL_CONFIG, _engine_handle, deploy_declared

# In the long run (-m slow): an application of its own, half a minute of a
# default run that must stay short.  The default run keeps the Predictor's
# `reconfigure` (tests/predictor/test_service.py).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "swap"
ARGS = {**SMALL_CONFIG, "predictor": {"enabled": True, "num_cpus": 0.5},
        "admission": {"enabled": False}}


def _predictor_info() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Predictor", app_name=APP).info.remote().result()


def test_a_new_adapter_is_swapped_in_without_restarting_a_replica(declared_server, tmp_path):
    import predictor

    engine = _engine_handle(APP)
    before = engine.stats.remote().result()
    assert _predictor_info()["swaps"] == 0
    adapter = tmp_path / "adapter"
    shutil.copytree(Path(predictor.__file__).parent / "adapters" / "smollm2-sharegpt", adapter)
    body = {"prompt": "Write a short poem about the ocean.", "max_tokens": 64,
            "temperature": 0, "ignore_eos": True}

    async def stream_while_redeploying() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300) as c:
            req = asyncio.create_task(c.post(f"{declared_server}/v1/completions", json=body))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(deploy_declared, APP, ARGS, [{
                "name": "Predictor",
                "user_config": {"adapter": str(adapter), "padding_ratio": 0.3}}])
            return await req

    r = asyncio.run(stream_while_redeploying())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64
    deadline = time.monotonic() + 120
    while (info := _predictor_info())["adapter"] != str(adapter):
        assert time.monotonic() < deadline, info
        time.sleep(0.5)
    assert info["padding_ratio"] == 0.3 and info["swaps"] >= 1
    after = engine.stats.remote().result()
    assert after["replica"] == before["replica"]
    assert after["num_finished"] > before["num_finished"]
    # It serves, the new adapter with the new padding.
    from ray import serve

    got = serve.get_deployment_handle("Predictor", app_name=APP).predict.remote(
        "Name the planets of the solar system.").result()
    assert got["allocation"] == max(1, math.ceil(got["predicted_len"] * 1.3 - 1e-9))
    r = httpx.post(f"{declared_server}/v1/completions", json={**body, "max_tokens": 4}, timeout=300)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
