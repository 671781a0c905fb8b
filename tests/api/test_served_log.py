"""The ingress records served completions for the predictor to retrain on
(`predictor.record_dir`): one line per choice with the text the predictor
reads, the answer's length and whether `max_tokens` cut it; nothing for
requests whose length the client forced."""

from __future__ import annotations

import json
from pathlib import Path

from api.tokenize_route import encode
from engine.tokenizer import render_chat
from predictor.dataset import read_served_completions
from tests.api.harness import harness


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("served-*.jsonl"))
            for line in f.read_text().splitlines()]


def test_finished_choices_are_recorded_with_their_ending(tmp_path: Path) -> None:
    with harness(predictor={"record_dir": str(tmp_path)}) as h:
        # The fake engine answers 3 tokens, ending by itself under a larger cap.
        r = h.client.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 10, "n": 2})
        assert r.status_code == 200, r.text
        r = h.client.post("/v1/completions", json={"prompt": "Count", "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = h.client.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Name a color."}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        # Forced lengths are not answer lengths.
        for extra in ({"ignore_eos": True}, {"min_tokens": 3}):
            r = h.client.post("/v1/completions",
                              json={"prompt": "Forced", "max_tokens": 5, **extra})
            assert r.status_code == 200, r.text
    recs = _records(tmp_path)
    assert [(x["prompt"], x["output_len"], x["finish_reason"], x["censored"]) for x in recs] == [
        ("Say hi", 3, "stop", False), ("Say hi", 3, "stop", False),
        ("Count", 2, "length", True),
        ("Name a color.", 3, "stop", False),
    ]
    # The prompt as the engine computed it, for `python -m predictor fit-head`.
    assert recs[0]["prompt_ids"] == recs[1]["prompt_ids"] == list(
        h.ingress.tokenizer("Say hi")["input_ids"])
    assert recs[3]["prompt_ids"] == encode(
        h.ingress.tokenizer,
        render_chat(h.ingress.tokenizer, [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Name a color."}]),
        "messages", chat=True)
    pairs = read_served_completions(tmp_path)  # the folder: every replica's log
    assert [(p.prompt, p.response_len) for p in pairs] == [
        ("Say hi", 3), ("Say hi", 3), ("Name a color.", 3)]


def test_nothing_is_recorded_by_default(tmp_path: Path) -> None:
    with harness() as h:
        assert h.ingress.served_log is None
        r = h.client.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 10})
        assert r.status_code == 200


def test_the_token_that_ended_an_answer_is_not_counted(tmp_path: Path) -> None:
    """As in the ShareGPT lengths the predictor learns: the answer's tokens
    before the end-of-sequence or stop token that ended it."""
    from tests.api.harness import _OUTPUT_TEXT

    with harness(predictor={"record_dir": str(tmp_path)}) as h:
        third = h.ingress.tokenizer(_OUTPUT_TEXT, add_special_tokens=False)["input_ids"][2]
        assert h.ingress.served_log.eos_ids  # the model's end-of-sequence ids
        # The fake engine's third token ends the answer: a stop token here.
        r = h.client.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 10,
                                                   "stop_token_ids": [third]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    assert [x["output_len"] for x in _records(tmp_path)] == [2]
