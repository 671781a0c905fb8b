"""Workloads: which requests arrive when, with which prompt and output length.

A workload is one or more *streams*, each with its own length source,
arrival process and job class, merged by arrival time:

- `sharegpt`: ShareGPT V3 first exchanges (bench/dataset.py), sampled
  without replacement under the seed (with replacement when more requests
  are asked for than the pool holds).
- `sharegpt` with `io_ratio`: FastServe §6.3 / Figure 14 "alter the ratios
  between input and output lengths while preserving the original length
  distribution": each sampled request keeps its total length L = in + out
  and is split as in = L·r/(1+r), out = L - in (at least one token each).
- `fixed`: every request has `input_len` prompt and `output_len` output
  tokens (FastServe Figure 1's "Fix-Len").

A stream may give every prompt the same beginning, `shared_prefix_tokens`
of a fixed text (an assistant's system prompt), the case a prefix cache
serves (vLLM's and SGLang's shared-prefix benchmark datasets).

Online / offline mixes (ConServe co-serving) are two streams, e.g. an
online Poisson stream of chat requests and an offline batch (rate = inf)
of long ones.

Output lengths are enforced on the server with ignore_eos + max_tokens
(+ min_tokens), so a run's token counts equal the workload's.

Prompt text: ShareGPT prompts are sent as is; synthetic prompts (fixed and
rescaled lengths) are a filler word that our tokenizer (and the usual BPE
vocabularies) encode as one token per repetition, after up to six other
one-token words that spell the request's number, so that no two requests
share a KV block (a server with prefix caching would otherwise compute
only the first of many identical prompts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench.arrivals import ArrivalSpec, arrival_times
from bench.dataset import LengthFilter, ShareGPTPool
from bench.records import JobClassName

FILLER_WORD = " hello"


# One token each under our tokenizer, as FILLER_WORD is, and none of them it.
_SALT_WORDS = (" world", " apple", " river", " green", " music", " table", " house", " stone",
               " light", " water", " paper", " night", " bread", " cloud", " chair")
_SALT_POSITIONS = 6


def filler_prompt(num_tokens: int, salt: int | None = None) -> str:
    """A prompt of `num_tokens` tokens under our tokenizer (one per word);
    with `salt`, its first words spell it (in base 15), so prompts of
    different salts differ from their first token on."""
    words = [FILLER_WORD] * num_tokens
    if salt is not None:
        base = len(_SALT_WORDS)
        for i in range(min(num_tokens, _SALT_POSITIONS)):
            words[i] = _SALT_WORDS[salt % base]
            salt //= base
    return "".join(words).lstrip()


class LengthSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: Literal["sharegpt", "fixed"] = "sharegpt"
    input_len: int = Field(512, ge=1)  # fixed
    output_len: int = Field(128, ge=1)  # fixed
    # ShareGPT with the input/output ratio rescaled (FastServe Figure 14).
    io_ratio: float | None = Field(None, gt=0)
    filter: LengthFilter = LengthFilter()


class StreamSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "main"
    job_class: JobClassName = "online"
    # vLLM's meaning (lower runs first), sent as the request's `priority`.
    priority: int = 0
    num_requests: int = Field(100, ge=0)
    lengths: LengthSpec = LengthSpec()
    arrivals: ArrivalSpec = ArrivalSpec()
    # Tokens of a system prompt every prompt of the stream begins with,
    # before its own text and a newline (the same text in every stream).
    shared_prefix_tokens: int = Field(0, ge=0)


class WorkloadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    streams: list[StreamSpec] = Field(default_factory=lambda: [StreamSpec()])

    def with_rate(self, rate: float, stream: int = 0) -> "WorkloadSpec":
        """The same workload with stream `stream` arriving at `rate`."""
        streams = list(self.streams)
        s = streams[stream]
        streams[stream] = s.model_copy(
            update={"arrivals": s.arrivals.model_copy(update={"rate": rate})}
        )
        return self.model_copy(update={"streams": streams})

    @property
    def needs_sharegpt(self) -> bool:
        return any(s.lengths.dataset == "sharegpt" for s in self.streams)


class RequestSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str
    job_class: JobClassName = "online"
    priority: int = 0
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    # None in simulator-only workloads (text is not needed there).
    prompt: str | None = None
    # Leading tokens of `prompt` that other requests' prompts begin with too.
    shared_prefix_tokens: int = 0
    # A response-length prediction replayed by the simulator (the trained
    # predictor's, studies/econoserve_sim); None: the job has none.
    predicted_output_tokens: int | None = None
    # Seconds after its arrival at which that prediction reaches the
    # scheduler (live, the predictor answers beside the prompt's
    # computation); None or 0: on arrival.
    prediction_delay_s: float | None = Field(None, ge=0.0)
    # The client's cap on the answer, when it is not the answer's length:
    # the job then ends by an end-of-sequence token at `output_tokens`,
    # which the scheduler does not know beforehand.  None: max_tokens =
    # output_tokens (ignore_eos).
    max_tokens: int | None = None


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: WorkloadSpec
    requests: list[RequestSpec]
    # Where the lengths came from (ShareGPT record counts etc.).
    source: dict[str, float | int | str] = Field(default_factory=dict)

    def save_jsonl(self, path: Path) -> None:
        with path.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"spec": self.spec.model_dump(), "source": self.source}) + "\n")
            for r in self.requests:
                f.write(r.model_dump_json() + "\n")

    @classmethod
    def load_jsonl(cls, path: Path) -> "Workload":
        with path.open(encoding="utf-8") as f:
            head = json.loads(f.readline())
            reqs = [RequestSpec.model_validate_json(line) for line in f if line.strip()]
        return cls(spec=WorkloadSpec.model_validate(head["spec"]), requests=reqs, source=head["source"])

    def stats(self) -> dict[str, float | int]:
        n = len(self.requests)
        if n == 0:
            return {"num_requests": 0}
        p = np.array([r.prompt_tokens for r in self.requests])
        o = np.array([r.output_tokens for r in self.requests])
        t = np.array([r.arrival_time for r in self.requests])
        span = float(t.max() - t.min())
        return {
            "num_requests": n,
            "num_offline": sum(r.job_class == "offline" for r in self.requests),
            "prompt_tokens_mean": float(p.mean()),
            "prompt_tokens_median": float(np.median(p)),
            "prompt_tokens_p99": float(np.percentile(p, 99)),
            "output_tokens_mean": float(o.mean()),
            "output_tokens_median": float(np.median(o)),
            "output_tokens_p99": float(np.percentile(o, 99)),
            "arrival_span_s": span,
            "offered_rate": (n - 1) / span if span > 0 else math.inf,
        }


def rescale_io_ratio(
    prompt: np.ndarray, output: np.ndarray, ratio: float
) -> tuple[np.ndarray, np.ndarray]:
    """Keep each total length, split it so that input/output = `ratio`."""
    total = prompt + output
    new_in = np.clip(np.rint(total * ratio / (1.0 + ratio)).astype(np.int64), 1, total - 1)
    return new_in, total - new_in


def shared_prefix(num_tokens: int) -> str:
    """The system prompt of `shared_prefix_tokens`: one token per word, and
    a newline (one more) before each request's own text."""
    return filler_prompt(num_tokens, salt=_SYSTEM_SALT) + "\n"


# A salt no request's own prompt gets in practice (the workload's size).
_SYSTEM_SALT = len(_SALT_WORDS) ** _SALT_POSITIONS - 1


def _stream_lengths(
    s: StreamSpec, pool: ShareGPTPool | None, rng: np.random.Generator, first_salt: int = 0
) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    n = s.num_requests
    ls = s.lengths
    if ls.dataset == "fixed":
        prompts: list[str | None] = [filler_prompt(ls.input_len, first_salt + i)
                                     for i in range(n)]
        return np.full(n, ls.input_len), np.full(n, ls.output_len), prompts
    if pool is None or len(pool) == 0:
        raise ValueError(f"stream {s.name!r} needs the ShareGPT pool")
    if n <= len(pool):
        idx = rng.permutation(len(pool))[:n]
    else:
        idx = rng.integers(0, len(pool), size=n)
    p, o = pool.prompt_tokens[idx], pool.output_tokens[idx]
    if ls.io_ratio is not None:
        p, o = rescale_io_ratio(p, o, ls.io_ratio)
        return p, o, [filler_prompt(int(k), first_salt + i) for i, k in enumerate(p)]
    texts: list[str | None] = (
        [pool.prompts[i] for i in idx] if pool.prompts is not None else [None] * n
    )
    return p, o, texts


def build_workload(
    spec: WorkloadSpec,
    pool: ShareGPTPool | Callable[[], ShareGPTPool] | None = None,
) -> Workload:
    """The requests of `spec`, sorted by arrival; deterministic given the seed.

    `pool` is the ShareGPT pool, or a loader called only if a stream needs
    it.  Each stream draws from its own generator spawned from the seed, so
    adding a stream does not change the others.
    """
    if callable(pool):
        pool = pool() if spec.needs_sharegpt else None
    seeds = np.random.SeedSequence(spec.seed).spawn(len(spec.streams))
    reqs: list[RequestSpec] = []
    salt = 0  # each synthetic prompt of the workload its own
    for s, ss in zip(spec.streams, seeds):
        len_rng, arr_rng = (np.random.default_rng(x) for x in ss.spawn(2))
        p, o, texts = _stream_lengths(s, pool, len_rng, salt)
        salt += s.num_requests
        if s.shared_prefix_tokens:
            head = shared_prefix(s.shared_prefix_tokens)
            texts = [None if x is None else head + x for x in texts]
            p = p + s.shared_prefix_tokens + 1
        t = arrival_times(s.arrivals, s.num_requests, arr_rng)
        prefix = s.name if len(spec.streams) > 1 else "req"
        for i in range(s.num_requests):
            reqs.append(
                RequestSpec(
                    request_id=f"{prefix}-{i}",
                    job_class=s.job_class,
                    priority=s.priority,
                    arrival_time=float(t[i]),
                    prompt_tokens=int(p[i]),
                    output_tokens=int(o[i]),
                    prompt=texts[i],
                    shared_prefix_tokens=s.shared_prefix_tokens,
                )
            )
    # Stable: ties keep stream order, then index order.
    reqs.sort(key=lambda r: r.arrival_time)
    source: dict[str, float | int | str] = {}
    if isinstance(pool, ShareGPTPool):
        source = {f"sharegpt_{k}": v for k, v in pool.stats().items()}
    return Workload(spec=spec, requests=reqs, source=source)
