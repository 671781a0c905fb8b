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

from tests.integration.conftest import (PROMPTS, SMALL_CONFIG, _engine_handle,
                                        deploy_declared, post_all)

# In the long run (-m slow): an application of its own, forty seconds of a
# default run that must stay short.  The default run keeps the head in
# process (tests/engine/test_length_head.py: its estimate at the first
# token, from graph replays, a head of another model refused).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "head"
ARGS = {
    **SMALL_CONFIG,
    "policy": "econoserve",
    "admission": {"enabled": False},
    "predictor": {"enabled": False, "engine_head": "embedded"},
}


def body(prompt: str, n: int = 8) -> dict:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}


def test_every_estimate_comes_from_the_engine_head(declared_server):
    from engine.length_head import LengthHead
    from engine.model_source import resolve_model
    from engine.tokenizer import load_tokenizer
    from predictor.fit_head import prompt_states

    got = [r["metrics"]["predicted_output_len"]
           for r in asyncio.run(post_all(declared_server, [body(p) for p in PROMPTS]))]
    path = resolve_model("embedded:smollm2")
    tok = load_tokenizer(path)
    ids = [list(tok(p)["input_ids"]) for p in PROMPTS]
    want = LengthHead.load("embedded").predict(
        prompt_states(path, ids, log_every=0), torch.tensor([len(i) for i in ids])).tolist()
    for p, g, w in zip(PROMPTS, got, want):
        # float32 on both sides, sums taken in another order.
        assert g is not None and abs(g - w) <= max(1, 0.02 * w), (p, g, w)
    assert len(set(got)) > 1, got


def test_a_new_head_is_swapped_in_without_restarting_the_replica(declared_server, tmp_path):
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
            req = asyncio.create_task(c.post(f"{declared_server}/v1/completions",
                                             json=body(PROMPTS[0], 64)))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(deploy_declared, APP, ARGS, [
                {"name": "Engine", "user_config": {"engine_head": str(tmp_path / "flat.pt")}}])
            return await req

    r = asyncio.run(stream_while_redeploying())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64
    deadline = time.monotonic() + 120
    while (after := engine.stats.remote().result())["length_head"] != str(tmp_path / "flat.pt"):
        assert time.monotonic() < deadline, after["length_head"]
        time.sleep(0.5)
    assert after["replica"] == before["replica"]
    got = [x["metrics"]["predicted_output_len"]
           for x in asyncio.run(post_all(declared_server, [body(p) for p in PROMPTS]))]
    assert got == [77] * len(PROMPTS)
