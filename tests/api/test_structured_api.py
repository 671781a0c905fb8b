"""Structured output on the wire: `response_format` and vLLM's
`structured_outputs` reach the engine as one grammar; what cannot be
enforced is a 400 naming the field, before the engine sees the request."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.sampling_params import StructuredOutput
from tests.api.harness import Harness

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(h: Harness, **extra: Any) -> Any:
    return h.client.post("/v1/chat/completions", json={
        "model": h.model_name, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4, **extra})


@pytest.mark.parametrize("extra, want", [
    ({"response_format": {"type": "json_object"}}, StructuredOutput(kind="json_object")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA, sort_keys=True))),
    # OpenAI's schema is optional: then any JSON object.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     StructuredOutput(kind="json_object")),
    ({"structured_outputs": {"json": SCHEMA}},
     StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA, sort_keys=True))),
    ({"structured_outputs": {"json": '{"type": "object"}'}},
     StructuredOutput(kind="json_schema", spec='{"type": "object"}')),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutput(kind="regex", spec="[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}},
     StructuredOutput(kind="choice", choices=("a", "b"))),
    ({"structured_outputs": {"grammar": 'root ::= "x" | "y"'}},
     StructuredOutput(kind="grammar", spec='root ::= "x" | "y"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(kind="json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
])
def test_the_structure_reaches_the_engine(served: Harness, extra: dict[str, Any],
                                          want: StructuredOutput | None) -> None:
    r = _chat(served, **extra)
    assert r.status_code == 200, r.text
    assert served.engine.requests[-1].structured == want


def test_completions_take_it_too(served: Harness) -> None:
    r = served.client.post("/v1/completions", json={
        "model": served.model_name, "prompt": "x", "max_tokens": 3, "stream": True,
        "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200, r.text
    assert served.engine.requests[-1].structured == StructuredOutput(
        kind="choice", choices=("yes", "no"))


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "bogus"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "cannot be enforced"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "JSON Schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "unrecognized"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name"}}},
     "response_format.json_schema.name", "pattern"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos",
     "end-of-sequence"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens", "end-of-sequence"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
])
def test_what_cannot_be_enforced_is_a_400(served: Harness, extra: dict[str, Any], param: str,
                                          words: str) -> None:
    before = len(served.engine.requests)
    r = _chat(served, **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert len(served.engine.requests) == before
