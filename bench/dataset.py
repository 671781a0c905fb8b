"""ShareGPT request pools: token lengths (cached) and vLLM's filters.

A ShareGPT request is the first human turn of a conversation as the prompt
and the token count of the assistant turn that answers it as the reference
output length (FastServe §6.1, vLLM's `benchmark_serving.py`); reading the
dataset and counting tokens is workloads/sharegpt.py's, shared with the
response-length predictor.

Tokenizing all 17k conversations takes ~25 s on the 2-core machines, so the
lengths are cached (one JSON per dataset file and tokenizer) under the
project cache directory; a cached run reads only the lengths and parses the
dataset JSON (~1 s) only when prompt texts are needed (live runs).

Filters are vLLM's (`is_valid_sequence`): drop a request whose prompt or
reference output is shorter than 4 tokens, whose prompt is longer than 1024
tokens, or whose prompt + output exceed 2048 tokens (OPT's context).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from workloads.sharegpt import (
    DEFAULT_TOKENIZER,
    TokenCounter,
    dataset_file,
    first_exchanges,
    load_sharegpt,
    token_counter,
)


class LengthFilter(BaseModel):
    """vLLM's `is_valid_sequence` bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_len: int = Field(4, ge=1)
    max_prompt_len: int = Field(1024, ge=1)
    max_total_len: int = Field(2048, ge=2)

    def mask(self, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
        return (
            (prompt >= self.min_len)
            & (output >= self.min_len)
            & (prompt <= self.max_prompt_len)
            & (prompt + output <= self.max_total_len)
        )


@dataclass(frozen=True)
class ShareGPTPool:
    """The ShareGPT requests that pass the filter, in dataset order."""

    num_records: int  # complete records kept from the truncated JSON
    truncated_bytes: int  # size of the cut-off tail that was dropped
    num_with_exchange: int  # records with a human turn answered by gpt
    prompt_tokens: np.ndarray  # int64, one per kept request
    output_tokens: np.ndarray
    prompts: list[str] | None  # texts, when loaded with need_text=True

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def stats(self) -> dict[str, float | int]:
        return {
            "complete_records": self.num_records,
            "truncated_tail_bytes": self.truncated_bytes,
            "records_with_exchange": self.num_with_exchange,
            "kept_after_filter": len(self),
            "mean_prompt_tokens": float(self.prompt_tokens.mean()) if len(self) else 0.0,
            "mean_output_tokens": float(self.output_tokens.mean()) if len(self) else 0.0,
        }


def _cache_dir() -> Path:
    base = os.environ.get("PREEMPT_SERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "preempt-serve"
    )
    return Path(base) / "bench"


def _cache_key(path: Path, tokenizer: str) -> str:
    st = path.stat()
    raw = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}:{tokenizer}"
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _all_lengths(
    path: Path, counter: TokenCounter
) -> tuple[dict[str, int], list[tuple[int, int]], list[str]]:
    """Lengths of every record's first exchange ((-1, -1) when it has none)."""
    load = load_sharegpt(path)
    pairs = first_exchanges(load)
    have = [p for p in pairs if p is not None]
    plen = counter([p[1] for p in have])
    olen = counter([p[2] for p in have])
    it = iter(zip(plen, olen))
    lengths = [next(it) if p is not None else (-1, -1) for p in pairs]
    prompts = [p[1] if p is not None else "" for p in pairs]
    meta = {
        "num_records": len(load.conversations),
        "truncated_bytes": load.truncated_bytes,
        "num_with_exchange": len(have),
    }
    return meta, lengths, prompts


def load_pool(
    *,
    path: Path | None = None,
    tokenizer: str = DEFAULT_TOKENIZER,
    counter: TokenCounter | None = None,
    length_filter: LengthFilter | None = None,
    need_text: bool = False,
    use_cache: bool = True,
) -> ShareGPTPool:
    """The filtered ShareGPT pool.

    `counter` overrides the tokenizer (tests pass a whitespace counter);
    the cache is used only with the named tokenizer.
    """
    path = path or dataset_file()
    flt = length_filter or LengthFilter()
    cache = _cache_dir() / f"sharegpt-lengths-{_cache_key(path, tokenizer)}.json"
    cacheable = use_cache and counter is None
    prompts: list[str] | None = None
    if cacheable and cache.is_file():
        data = json.loads(cache.read_text())
        meta, lengths = data["meta"], data["lengths"]
    else:
        meta, lengths, prompts = _all_lengths(path, counter or token_counter(tokenizer))
        if cacheable:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps({"meta": meta, "tokenizer": tokenizer, "lengths": lengths}))
            os.replace(tmp, cache)
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1, 2)
    keep = (arr[:, 0] >= 0) & flt.mask(arr[:, 0], arr[:, 1])
    idx = np.flatnonzero(keep)
    if need_text and prompts is None:
        prompts = [p[1] if p is not None else "" for p in first_exchanges(load_sharegpt(path))]
    return ShareGPTPool(
        num_records=int(meta["num_records"]),
        truncated_bytes=int(meta["truncated_bytes"]),
        num_with_exchange=int(meta["num_with_exchange"]),
        prompt_tokens=arr[idx, 0].copy(),
        output_tokens=arr[idx, 1].copy(),
        prompts=[prompts[i] for i in idx] if need_text and prompts is not None else None,
    )
