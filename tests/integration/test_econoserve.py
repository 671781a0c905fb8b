"""`policy: econoserve` live: the predictor's estimates and their padded
allocations reach the engine through the ingress, generation tasks are
admitted to the batch by their allocations in a device cache too small for
all of them, and greedy outputs match the same prompts run one at a time
on the FCFS application (preemption transparency)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.integration.conftest import (PROMPTS, SMALL_CONFIG, _deploy, _engine_handle, post_all,
                                        reference_texts, wait_engine_idle)

pytestmark = pytest.mark.integration

APP = "econo"
ECONO_CONFIG = {
    **SMALL_CONFIG,
    "policy": "econoserve",
    # 32 device blocks for 8 jobs of ~5 blocks each.
    "kv_cache_tokens": 512,
    "max_batch_size": 4,
    "max_model_len": 512,
    "admission": {"enabled": False},
    "predictor": {"enabled": True, "num_cpus": 0.5},
    "econoserve": {"pt_reserve": 0.1},
}


@pytest.fixture(scope="module")
def econo_server(server):
    from ray import serve

    yield _deploy(server, APP, ECONO_CONFIG)
    serve.delete(APP)


def body(prompt: str, n: int = 48, **extra: object) -> dict:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}


async def _all(base: str) -> list[dict]:
    return await post_all(base, [body(p, **({"jct_slo_s": 5.0} if i % 2 else {}))
                                 for i, p in enumerate(PROMPTS)])


def test_econoserve_serves_every_prompt_as_fcfs_does(server, econo_server):
    concurrent = asyncio.run(_all(econo_server))
    stats = wait_engine_idle(_engine_handle(APP), timeout=60)
    policy = stats["policy"]
    assert policy["name"] == "econoserve"
    assert policy["econoserve_gts_admitted"] >= len(PROMPTS)
    refs = reference_texts(server, [body(p) for p in PROMPTS])
    for p, got, ref in zip(PROMPTS, concurrent, refs):
        assert got["choices"][0]["text"] == ref, p
        assert got["usage"]["completion_tokens"] == 48
    predicted = [r["metrics"]["predicted_output_len"] for r in concurrent]
    assert sum(p is not None for p in predicted) >= len(PROMPTS) // 2, predicted


def test_a_bad_jct_slo_is_refused_by_name(econo_server):
    r = httpx.post(f"{econo_server}/v1/completions", json=body("Hi", jct_slo_s=-1), timeout=60)
    assert r.status_code == 400
    assert "jct_slo_s" in r.text
