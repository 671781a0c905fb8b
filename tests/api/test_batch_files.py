"""`GET /v1/files`, `DELETE /v1/files/{id}` and files' expiry on the real
ingress app, without Ray (fake Jobs API: tests/api/harness.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.api.harness import Harness, harness
from tests.api.shapes import assert_error
from tests.api.test_batch_routes import CHAT, create, jsonl, upload


@pytest.fixture
def fresh() -> Iterator[Harness]:
    """A store of its own: listings see only this test's files."""
    with harness() as h:
        yield h


def test_files_are_listed_newest_first_and_paged(fresh: Harness) -> None:
    ids = [upload(fresh, jsonl(CHAT)).json()["id"] for _ in range(3)]
    b = fresh.ingress.batches.store.batch(create(fresh).json()["id"]).model_dump()
    every = fresh.client.get("/v1/files").json()
    assert every["object"] == "list" and every["has_more"] is False
    listed = [f["id"] for f in every["data"]]
    assert set(listed) == {*ids, b["input_file_id"], b["output_file_id"], b["error_file_id"]}
    created = [f["created_at"] for f in every["data"]]
    assert created == sorted(created, reverse=True)
    assert (every["first_id"], every["last_id"]) == (listed[0], listed[-1])
    asc = fresh.client.get("/v1/files", params={"order": "asc"}).json()
    assert [f["id"] for f in asc["data"]] == listed[::-1]
    page = fresh.client.get("/v1/files", params={"limit": 2, "order": "asc"}).json()
    rest = fresh.client.get("/v1/files", params={"after": page["last_id"],
                                                 "order": "asc"}).json()
    assert page["has_more"] is True and rest["has_more"] is False
    assert [f["id"] for f in page["data"] + rest["data"]] == listed[::-1]
    inputs = fresh.client.get("/v1/files", params={"purpose": "batch"}).json()["data"]
    assert {f["id"] for f in inputs} == {*ids, b["input_file_id"]}
    outputs = fresh.client.get("/v1/files", params={"purpose": "batch_output"}).json()["data"]
    assert {f["id"] for f in outputs} == {b["output_file_id"], b["error_file_id"]}
    # An upload's listed entry is its File object.
    assert fresh.client.get(f"/v1/files/{ids[0]}").json() in every["data"]
    for params, param in (({"limit": 0}, "limit"), ({"limit": 10001}, "limit"),
                          ({"order": "up"}, "order"), ({"x": "1"}, "x")):
        assert_error(fresh.client.get("/v1/files", params=params), 400, param)
    assert_error(fresh.client.get("/v1/files", params={"after": "file-nope"}), 404, "after")


def test_a_file_is_deleted_unless_a_running_batch_uses_it(fresh: Harness) -> None:
    data = jsonl(CHAT)
    loose = upload(fresh, data).json()["id"]
    r = fresh.client.delete(f"/v1/files/{loose}")
    assert r.status_code == 200, r.text
    assert r.json() == {"id": loose, "object": "file", "deleted": True}
    assert_error(fresh.client.get(f"/v1/files/{loose}"), 404, "file_id")
    assert_error(fresh.client.get(f"/v1/files/{loose}/content"), 404, "file_id")
    assert_error(fresh.client.delete(f"/v1/files/{loose}"), 404, "file_id")
    b = fresh.ingress.batches.store.batch(create(fresh).json()["id"]).model_dump()
    err = assert_error(fresh.client.delete(f"/v1/files/{b['input_file_id']}"), 400)
    assert b["id"] in err["message"] and "cancel" in err["message"]
    assert fresh.client.get(f"/v1/files/{b['input_file_id']}").status_code == 200
    fresh.jobs.status[f"{b['id']}-1"] = "SUCCEEDED"
    assert fresh.client.delete(f"/v1/files/{b['input_file_id']}").status_code == 200
    fresh.jobs.down = True
    try:  # whether a batch runs is the Jobs API's to say
        assert fresh.client.delete(f"/v1/files/{b['output_file_id']}").status_code == 503
    finally:
        fresh.jobs.down = False
    assert fresh.client.get(f"/v1/files/{b['output_file_id']}").status_code == 200


def test_an_upload_expires_as_asked_or_by_default(fresh: Harness) -> None:
    before = int(time.time())
    asked = upload(fresh, jsonl(CHAT), **{"expires_after[anchor]": "created_at",
                                          "expires_after[seconds]": "3600"}).json()
    assert asked["expires_at"] - asked["created_at"] == 3600
    default = upload(fresh, jsonl(CHAT)).json()
    assert default["expires_at"] - default["created_at"] == 720 * 3600
    assert default["created_at"] >= before
    made = create(fresh, input_file_id=asked["id"],
                  output_expires_after={"anchor": "created_at", "seconds": 7200}).json()
    b = fresh.ingress.batches.store.batch(made["id"]).model_dump()
    out = fresh.client.get(f"/v1/files/{b['output_file_id']}").json()
    assert out["expires_at"] - b["created_at"] == 7200
    with harness(batch={"upload_expiry_hours": None,
                        "completion_window_hours": None}) as kept:
        assert upload(kept, jsonl(CHAT)).json()["expires_at"] is None
        assert create(kept).json()["expires_at"] is None  # runs until done


def test_expired_files_are_gone_and_swept_on_the_next_listing(fresh: Harness) -> None:
    store = fresh.ingress.batches.store
    fresh.ingress.batch_routes._swept = time.monotonic()  # no sweep at the upload
    f = upload(fresh, jsonl(CHAT)).json()
    record = store.file(f["id"])
    assert record is not None
    store._save_file(record.model_copy(update={"expires_at": int(time.time()) - 1}))
    assert_error(fresh.client.get(f"/v1/files/{f['id']}"), 404, "file_id")
    assert_error(create(fresh, input_file_id=f["id"]), 404, "input_file_id")
    assert store.content_path(record).exists()  # not swept yet
    fresh.ingress.batch_routes._swept = -1e9
    assert f["id"] not in [g["id"] for g in fresh.client.get("/v1/files").json()["data"]]
    deadline = time.monotonic() + 5  # swept apart from the listing
    while store.content_path(record).exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert store.file(f["id"], expired=True) is None
