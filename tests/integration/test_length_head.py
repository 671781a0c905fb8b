"""`predictor.engine_head` live: with no Predictor deployment, every
request's length estimate comes from the engine's length head at its first
token (the shipped head for the embedded model), equal to the head applied
to the model's own state at the prompt's last position."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tests.integration.conftest import PROMPTS, SMALL_CONFIG, _deploy

pytestmark = pytest.mark.integration

APP = "head"
HEAD_CONFIG = {
    **SMALL_CONFIG,
    "policy": "econoserve",
    "admission": {"enabled": False},
    "predictor": {"enabled": False, "engine_head": "embedded"},
}


@pytest.fixture(scope="module")
def head_server(server):
    from ray import serve

    yield _deploy(server, APP, HEAD_CONFIG)
    serve.delete(APP)


async def _all(base: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=300) as c:
        rs = await asyncio.gather(*(
            c.post(f"{base}/v1/completions",
                   json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
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
