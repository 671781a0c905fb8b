"""Runtime LoRA adapters as clients meet them (`lora_runtime`): vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, the name served as
a `model` by every Ingress replica with its folder carried to the engine,
and refusals naming the field."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.harness import Harness, harness


def _adapter(path: Path, **cfg: Any) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, **cfg}))
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    _adapter(root / "sql")
    _adapter(root / "sql-v2")
    _adapter(root / "dora", use_dora=True)
    (root / "empty").mkdir()
    _adapter(tmp_path / "outside")
    os.symlink(tmp_path / "outside", root / "link-out")
    return root


def _settings(root: Path) -> dict[str, Any]:
    return {"enabled": True, "root": str(root), "storage_dir": str(root.parent / "registry")}


@pytest.fixture
def two(root: Path, tmp_path: Path) -> Iterator[tuple[Harness, Harness]]:
    """Two Ingress replicas of one application (one registry)."""
    fixed = _adapter(tmp_path / "fixed")
    with harness(max_model_len=1024, lora_runtime=_settings(root),
                 lora_adapters={"fixed": str(fixed)}) as a, \
            harness(max_model_len=1024, lora_runtime=_settings(root),
                    lora_adapters={"fixed": str(fixed)}) as b:
        yield a, b


def _load(h: Harness, **body: Any) -> Any:
    return h.client.post("/v1/load_lora_adapter", json=body)


def _chat(h: Harness, model: str) -> Any:
    return h.client.post("/v1/chat/completions", json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})


def test_a_loaded_adapter_is_served_by_every_replica_until_unloaded(
        two: tuple[Harness, Harness], root: Path) -> None:
    a, b = two
    r = _load(a, lora_name="sql-lora", lora_path="sql")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql-lora' added successfully."
    ids = [m["id"] for m in b.client.get("/v1/models").json()["data"]]
    assert ids == [b.model_name, "fixed", "sql-lora"]
    card = b.client.get("/v1/models/sql-lora").json()
    assert card["parent"] == b.model_name and card["root"] == str((root / "sql").resolve())
    assert _chat(b, "sql-lora").status_code == 200
    req = b.engine.requests[-1]
    assert (req.adapter, req.adapter_path) == ("sql-lora", str((root / "sql").resolve()))
    assert req.adapter_loaded_at is not None and str(req.adapter_loaded_at) in req.cache_salt
    assert b.client.post("/tokenize", json={"model": "sql-lora", "prompt": "x"}).status_code \
        == 200
    # The fixed adapter goes without a folder: the engine loaded it at start.
    assert _chat(a, "fixed").status_code == 200 and a.engine.requests[-1].adapter_path is None
    # Loaded again in place: a new version, whose KV is cached apart.
    salt = req.cache_salt
    assert _load(a, lora_name="sql-lora", lora_path=str(root / "sql-v2"),
                 load_inplace=True).status_code == 200
    assert _chat(b, "sql-lora").status_code == 200
    again = b.engine.requests[-1]
    assert again.adapter_path.endswith("sql-v2") and again.cache_salt != salt
    r = b.client.post("/v1/unload_lora_adapter", json={"lora_name": "sql-lora"})
    assert r.status_code == 200 and "removed" in r.text
    r = _chat(a, "sql-lora")
    assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"
    r = a.client.post("/v1/unload_lora_adapter", json={"lora_name": "sql-lora"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize("body, param, words", [
    ({"lora_name": "x", "lora_path": "../outside"}, "lora_path", "outside the folder"),
    ({"lora_name": "x", "lora_path": "link-out"}, "lora_path", "outside the folder"),
    ({"lora_name": "x", "lora_path": "/etc"}, "lora_path", "outside the folder"),
    ({"lora_name": "x", "lora_path": "empty"}, "lora_path", "no adapter_config.json"),
    ({"lora_name": "x", "lora_path": "dora"}, "lora_path", "use_dora"),
    ({"lora_name": "fixed", "lora_path": "sql"}, "lora_name", "loaded at start"),
    ({"lora_name": "smollm2", "lora_path": "sql"}, "lora_name", "loaded at start"),
    ({"lora_name": "bad name!", "lora_path": "sql"}, "lora_name", "letters, digits"),
    ({"lora_name": "x"}, "lora_path", "required"),
    ({"lora_name": "x", "lora_path": "sql", "lora_int_id": 3}, "lora_int_id", ""),
])
def test_bad_loads_are_400s_naming_the_field(two: tuple[Harness, Harness], body: dict[str, Any],
                                             param: str, words: str) -> None:
    a, _ = two
    r = _load(a, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words.lower() in err["message"].lower(), err
    assert [m["id"] for m in a.client.get("/v1/models").json()["data"]] == \
        [a.model_name, "fixed"]


def test_a_name_is_loaded_once_unless_in_place(two: tuple[Harness, Harness]) -> None:
    a, b = two
    assert _load(a, lora_name="t", lora_path="sql").status_code == 200
    r = _load(b, lora_name="t", lora_path="sql-v2")
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = b.client.post("/v1/unload_lora_adapter", json={"lora_name": "fixed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"


def test_the_routes_are_documented_when_served_and_absent_otherwise(
        two: tuple[Harness, Harness], served: Harness) -> None:
    a, _ = two
    paths = a.client.get("/openapi.json").json()["paths"]
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(paths)
    assert "/v1/load_lora_adapter" not in served.client.get("/openapi.json").json()["paths"]
    r = served.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"})
    assert r.status_code == 404
