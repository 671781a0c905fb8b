"""Reading batch input files (batch/lines.py): each non-blank line is a
request or a refusal that names its line."""

from __future__ import annotations

import json

from batch.lines import Rejected, Request, count_lines, first_endpoint, parse_batch


def line(custom_id: str = "a", url: str = "/v1/chat/completions", **extra: object) -> str:
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in url \
        else {"prompt": "hi"}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body, **extra})


def test_well_formed_lines_become_requests() -> None:
    data = "\n".join([line("a"), line("b", "/v1/completions")]).encode()
    items = parse_batch(data)
    assert items == [
        Request(1, "a", "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}]}),
        Request(2, "b", "/v1/completions", {"prompt": "hi"}),
    ]


def test_blank_lines_are_skipped_but_counted_as_lines() -> None:
    data = f"\n{line('a')}\r\n   \n{line('b')}\n\n".encode()
    items = parse_batch(data)
    assert [(i.line, i.custom_id) for i in items] == [(2, "a"), (4, "b")]
    assert all(isinstance(i, Request) for i in items)
    assert count_lines(data) == 2


def _rejected(data: bytes) -> Rejected:
    (item,) = parse_batch(data)
    assert isinstance(item, Rejected), item
    assert item.error.line == item.line == 1
    return item


def test_malformed_json_is_refused_with_its_line() -> None:
    for bad in (b'{"custom_id": "a", ', b"not json", b'{"custom_id": NaN}', b"\xff\xfe",
                b"[1, 2]", b'{"custom_id": "\\ud800"}'):
        item = _rejected(bad)
        assert item.error.code == "invalid_json", (bad, item)
        assert item.custom_id is None
        assert item.error.message


def test_a_wrong_line_shape_names_the_field() -> None:
    cases = {
        "method": line(method="GET"),
        "url": line(url="/v1/embeddings"),
        "custom_id": json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
        "body": json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                            "body": "prompt"}),
        "extra": line(extra=1),
    }
    for param, text in cases.items():
        item = _rejected(text.encode())
        assert (item.error.code, item.error.param) == ("invalid_request", param), item
        assert param in item.error.message
    # Where the custom_id itself is fine, the refusal carries it.
    assert _rejected(line("keep", method="GET").encode()).custom_id == "keep"


def test_a_url_other_than_the_batch_endpoint_is_refused() -> None:
    data = "\n".join([line("a"), line("b", "/v1/completions")]).encode()
    items = parse_batch(data, endpoint="/v1/completions")
    assert isinstance(items[0], Rejected) and items[0].error.code == "invalid_url"
    assert items[0].custom_id == "a" and items[0].error.param == "url"
    assert isinstance(items[1], Request)


def test_a_duplicated_custom_id_refuses_every_line_naming_it() -> None:
    data = "\n".join([line("x"), line("y"), line("x"), "oops", line("x")]).encode()
    items = parse_batch(data)
    dup = [i for i in items if isinstance(i, Rejected) and i.error.code == "duplicate_custom_id"]
    assert [i.line for i in dup] == [1, 3, 5]
    assert all(i.custom_id == "x" and "3 lines" in i.error.message for i in dup)
    assert isinstance(items[1], Request) and items[1].custom_id == "y"


def test_first_endpoint_is_the_first_well_formed_url() -> None:
    data = "\n".join(["junk", line("a", "/v1/embeddings"), line("b", "/v1/completions"),
                      line("c")]).encode()
    assert first_endpoint(data) == "/v1/completions"
    assert first_endpoint(b"junk\n") == "/v1/chat/completions"
