"""LoRA adapters as clients meet them (`lora_adapters`): listed as models,
named by `model`, carried to the engine with KV cached apart from the base
model's; a bad setting fails at start naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.config import AppConfig
from tests.api.harness import Harness, harness
from tests.api.shapes import assert_error


def _adapter_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return path


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    folder = _adapter_folder(tmp_path_factory.mktemp("lora") / "sql")
    with harness(max_model_len=1024, lora_adapters={"sql-lora": str(folder)}) as h:
        yield h


def _chat(h: Harness, model: str, **extra: object) -> dict:
    r = h.client.post("/v1/chat/completions", json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_adapters_are_listed_as_models_of_their_base(h: Harness) -> None:
    cards = h.client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [h.model_name, "sql-lora"]
    adapter = h.client.get("/v1/models/sql-lora").json()
    assert adapter["parent"] == h.model_name and adapter["root"].endswith("sql")
    assert "parent" not in cards[0]


def test_a_request_naming_an_adapter_runs_it_with_its_own_cached_kv(h: Harness) -> None:
    out = _chat(h, "sql-lora", cache_salt="tenant-1")
    req = h.engine.requests[-1]
    assert out["model"] == "sql-lora" and req.adapter == "sql-lora"
    assert req.cache_salt is not None and req.cache_salt != "tenant-1"
    salted = req.cache_salt
    _chat(h, "sql-lora")
    assert h.engine.requests[-1].cache_salt not in (None, salted)  # the tenant's salt counts
    out = _chat(h, h.model_name, cache_salt="tenant-1")
    base = h.engine.requests[-1]
    assert out["model"] == h.model_name and base.adapter is None
    assert base.cache_salt == "tenant-1"


def test_responses_and_tokenize_take_an_adapter_and_unknown_models_are_404(h: Harness) -> None:
    r = h.client.post("/v1/responses", json={"model": "sql-lora", "input": "x",
                                             "max_output_tokens": 4, "store": False})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql-lora" and h.engine.requests[-1].adapter == "sql-lora"
    r = h.client.post("/tokenize", json={"model": "sql-lora", "prompt": "hello"})
    assert r.status_code == 200 and r.json()["tokens"]
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                              "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"}),
                       ("/tokenize", {"prompt": "x"})):
        err = assert_error(h.client.post(path, json={"model": "other-lora", **body}), 404,
                           param="model")
        assert "'sql-lora'" in err["message"]
    assert_error(h.client.get("/v1/models/other-lora"), 404, param="model")


def test_bad_adapter_settings_fail_at_start_naming_the_field(tmp_path: Path) -> None:
    folder = _adapter_folder(tmp_path / "a")
    with pytest.raises(ValidationError, match="(?s)lora_adapters.*no adapter_config.json"):
        AppConfig(lora_adapters={"x": str(tmp_path / "missing")})
    with pytest.raises(ValidationError, match="(?s)lora_adapters.*name"):
        AppConfig(lora_adapters={"bad name": str(folder)})
    with pytest.raises(ValidationError, match="(?s)lora_adapters.*base model's name"):
        AppConfig(lora_adapters={"smollm2": str(folder)})
    with pytest.raises(ValidationError, match="(?s)lora_adapters.*tensor_parallel_size"):
        AppConfig(lora_adapters={"x": str(folder)}, tensor_parallel_size=2)
    assert AppConfig(lora_adapters={"org/x-1": str(folder)}).lora_adapters == {
        "org/x-1": str(folder)}


class _Count:
    def __init__(self) -> None:
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, value: float, tags: dict[str, str]) -> None:
        key = tuple(tags[k] for k in sorted(tags))
        self.values[key] = self.values.get(key, 0) + value


def test_the_dashboard_counts_requests_and_tokens_by_model(h: Harness) -> None:
    metrics = h.ingress.metrics
    saved = metrics.requests, metrics.tokens
    metrics.requests, metrics.tokens = _Count(), _Count()
    try:
        adapter = _chat(h, "sql-lora")
        _chat(h, "sql-lora")
        base = _chat(h, h.model_name)
        r = h.client.post("/v1/messages", json={"model": "sql-lora", "max_tokens": 3,
                                                "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200, r.text
        requests, tokens = metrics.requests.values, metrics.tokens.values
    finally:
        metrics.requests, metrics.tokens = saved
    # Tags sorted by key: (model, outcome) and (kind, model).
    assert requests == {("sql-lora", "finished"): 3, (h.model_name, "finished"): 1}
    assert tokens[("generated", h.model_name)] == base["usage"]["completion_tokens"]
    assert tokens[("prompt", "sql-lora")] == 2 * adapter["usage"]["prompt_tokens"] + \
        r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"]
