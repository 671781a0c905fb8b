"""The shared ShareGPT reader: truncated file, first exchanges, token lengths."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workloads.sharegpt import first_exchanges, load_sharegpt, token_lengths


def _write(path: Path) -> Path:
    recs = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "be brief"},
                                      {"from": "human", "value": "sum 1 2"}, {"from": "gpt", "value": "3"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "unanswered"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "cut off"}, {"from": "gpt", "value": "x"}]},
    ]
    text = json.dumps(recs)
    path.write_text(text[:-20])  # the packaged file ends inside its last record too
    return path


def test_first_exchanges_keep_dataset_order_and_mark_the_unanswered(tmp_path: Path) -> None:
    load = load_sharegpt(_write(tmp_path / "sg.json"))
    assert [c.id for c in load.conversations] == ["a", "b", "c"] and load.truncated_bytes > 0
    assert first_exchanges(load) == [("a", "hi there", "hello"), ("b", "sum 1 2", "3"), None]


class _Words:
    """A tokenizer-shaped callable: one id per word, records each batch's size."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def __call__(self, texts: Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        assert add_special_tokens is False  # lengths never count BOS/EOS
        self.batches.append(len(texts))
        return {"input_ids": [t.split() for t in texts]}


def test_token_lengths_are_per_text_whatever_the_batch() -> None:
    tok = _Words()
    texts = ["a b c", "", "d e", "f"]
    assert token_lengths(tok, texts, batch=3) == [3, 0, 2, 1]
    assert tok.batches == [3, 1]
