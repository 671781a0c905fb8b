"""(prompt, response length) pairs: ShareGPT V3 and our own served completions.

ShareGPT (EconoServe §2.3): prompt = first human turn, RL = number of tokens
of the first assistant answer under the *served* model's tokenizer (the KV
cache holds that model's tokens).  10K requests are set aside for fine-tuning
(70 % train / 30 % test); all other requests are the serving workload and are
never trained on.

The split is keyed by a hash of the prompt text, not by position: ShareGPT
repeats prompts ("continue", "hi", ...), and a prompt must not sit in train
and test (or fine-tune and serving) at once, or the test figures leak.  Whole
prompt groups are assigned in hash order, skipping a group that would overflow
a split, so the sizes are exact (10,000 / 7,000 / 3,000) and the result does
not depend on record order.

Built datasets are cached as JSONL under `config.cache_dir()/datasets`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from predictor.config import DatasetConfig, ModelConfig, cache_dir
from workloads.sharegpt import dataset_file, first_exchanges, load_sharegpt, load_tokenizer, token_lengths

Split = Literal["train", "test", "serve"]


class LengthPair(BaseModel):
    """One training/evaluation example."""

    model_config = ConfigDict(frozen=True)

    id: str
    prompt: str
    prompt_tokens: int  # full (untruncated) prompt length, a head feature
    response_len: int  # the target RL
    split: str = "train"


class DatasetSplits(BaseModel):
    train: list[LengthPair]
    test: list[LengthPair]
    serve: list[LengthPair]
    path: str | None = None  # the cache file it was read from / written to


# ---------------------------------------------------------------- tokenizer

# `load_tokenizer` and `token_lengths` are workloads/sharegpt.py's: the lengths
# trained on are the lengths the benchmark replays.


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str], head: int, tail: int, chat: bool = False
) -> tuple[list[list[int]], list[int]]:
    """Token ids truncated to the first `head` + last `tail` tokens, and full lengths.

    `chat` frames the truncated ids in the tokenizer's chat template
    (predictor/prompt_format.py); the lengths stay those of the bare prompt.
    """
    if not prompts:
        return [], []
    enc = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    fallback = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids: list[list[int]] = []
    for x in enc:
        if len(x) > head + tail:
            x = x[:head] + (x[len(x) - tail :] if tail else [])
        ids.append(list(x) if x else [fallback])  # an empty prompt still gets one token
    if chat:
        from predictor.prompt_format import chat_frame

        before, after = chat_frame(tokenizer)
        ids = [before + x + after for x in ids]
    return ids, [len(x) for x in enc]


def model_inputs(tokenizer: Any, prompts: Sequence[str], cfg: ModelConfig) -> tuple[list[list[int]], list[int]]:
    """`encode_prompts` with the truncation and framing an adapter was trained with."""
    return encode_prompts(tokenizer, prompts, cfg.prompt_head, cfg.prompt_tail, cfg.prompt_format == "chat")


# ------------------------------------------------------------------- split


def _key(seed: int, salt: str, prompt: str) -> str:
    return hashlib.sha256(f"{seed}\0{salt}\0{prompt}".encode()).hexdigest()


def _fill(groups: list[list[int]], target: int) -> tuple[list[int], list[int]]:
    """Take whole groups in order until exactly `target` members (skip overflow)."""
    taken: list[int] = []
    rest: list[int] = []
    for g in groups:
        if len(taken) + len(g) <= target:
            taken.extend(g)
        else:
            rest.extend(g)
    return taken, rest


def split_pairs(
    prompts: Sequence[str], n_finetune: int, test_fraction: float, seed: int
) -> list[Split]:
    """Assign each record to train/test/serve; deterministic and prompt-disjoint."""
    by_prompt: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_prompt[p.strip()].append(i)
    order = sorted(by_prompt, key=lambda p: _key(seed, "finetune", p))
    finetune, _ = _fill([by_prompt[p] for p in order], min(n_finetune, len(prompts)))
    ft_set = set(finetune)
    ft_prompts = sorted(
        {prompts[i].strip() for i in ft_set}, key=lambda p: _key(seed, "test", p)
    )
    n_test = round(len(finetune) * test_fraction)
    test, _ = _fill([by_prompt[p] for p in ft_prompts], n_test)
    test_set = set(test)
    return [
        "test" if i in test_set else "train" if i in ft_set else "serve"
        for i in range(len(prompts))
    ]


# ---------------------------------------------------------------- ShareGPT


def sharegpt_records() -> list[tuple[str, str, str]]:
    """(id, prompt, answer) of each conversation's first exchange."""
    return [ex for ex in first_exchanges(load_sharegpt()) if ex is not None]


def build_pairs(
    records: Sequence[tuple[str, str, str]], tokenizer: Any, cfg: DatasetConfig
) -> DatasetSplits:
    """Filter, measure and split (id, prompt, answer) records."""
    records = [r for r in records if r[1].strip()]
    plen = token_lengths(tokenizer, [r[1] for r in records])
    rlen = token_lengths(tokenizer, [r[2] for r in records])
    keep = [
        i
        for i in range(len(records))
        if cfg.min_response_tokens <= rlen[i] <= cfg.max_response_tokens
    ]
    prompts = [records[i][1] for i in keep]
    splits = split_pairs(prompts, cfg.n_finetune, cfg.test_fraction, cfg.seed)
    out: dict[str, list[LengthPair]] = {"train": [], "test": [], "serve": []}
    for i, s in zip(keep, splits):
        rid, prompt, _ = records[i]
        out[s].append(
            LengthPair(
                id=rid, prompt=prompt, prompt_tokens=plen[i], response_len=rlen[i], split=s
            )
        )
    return DatasetSplits(**out)


def _dataset_path(cfg: DatasetConfig) -> Path:
    from engine.model_source import resolve_model

    src = dataset_file()
    tok_dir = resolve_model(cfg.tokenizer)
    tok_file = tok_dir / "tokenizer.json"
    ident = json.dumps(
        {
            "cfg": cfg.model_dump(),
            "src": [src.name, src.stat().st_size],
            "tok": [str(tok_dir), tok_file.stat().st_size if tok_file.exists() else 0],
            "v": 1,
        },
        sort_keys=True,
    )
    h = hashlib.sha256(ident.encode()).hexdigest()[:12]
    return cache_dir() / "datasets" / f"sharegpt-{h}.jsonl"


def write_jsonl(path: Path, pairs: Iterable[LengthPair]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in pairs:
            f.write(p.model_dump_json() + "\n")
    tmp.replace(path)


def read_jsonl(path: Path) -> list[LengthPair]:
    with path.open(encoding="utf-8") as f:
        return [LengthPair.model_validate_json(line) for line in f if line.strip()]


def splits_from_pairs(pairs: Sequence[LengthPair], path: str | None = None) -> DatasetSplits:
    out: dict[str, list[LengthPair]] = {"train": [], "test": [], "serve": []}
    for p in pairs:
        out[p.split].append(p)
    return DatasetSplits(**out, path=path)


def load_sharegpt_splits(cfg: DatasetConfig | None = None, rebuild: bool = False) -> DatasetSplits:
    """The ShareGPT splits, from the JSONL cache (built on first use)."""
    cfg = cfg or DatasetConfig()
    path = _dataset_path(cfg)
    if path.is_file() and not rebuild:
        return splits_from_pairs(read_jsonl(path), str(path))
    splits = build_pairs(sharegpt_records(), load_tokenizer(cfg.tokenizer), cfg)
    write_jsonl(path, [*splits.train, *splits.test, *splits.serve])
    splits.path = str(path)
    return splits


# ------------------------------------------------------- served completions

# A line of the served-completions log: {"prompt": str, "output_len": int}
# ("output_tokens" / "completion_tokens" accepted as aliases), optionally
# "id" and "finish_reason".  The length is what the served model produced,
# counted in its own tokens (EconoServe §3.3.2: the predictor "undergoes
# continual retraining in the system").
_LEN_KEYS = ("output_len", "output_tokens", "completion_tokens")


def read_served_completions(path: Path, tokenizer: Any | None = None) -> list[LengthPair]:
    """(prompt, answer length) pairs from a served-completions log, or from
    every `.jsonl` log in a folder (one per Ingress replica); rows marked
    `censored` are left out."""
    rows: list[dict[str, Any]] = []
    files = sorted(Path(path).glob("*.jsonl")) if Path(path).is_dir() else [Path(path)]
    for fpath in files:
        with fpath.open(encoding="utf-8") as f:
            for n, line in enumerate(f):
                if not line.strip():
                    continue
                row = json.loads(line)
                if row.get("censored"):
                    # Cut by max_tokens (deployments/served_log.py): a lower
                    # bound of the answer's length, not its length.
                    continue
                length = next((row[k] for k in _LEN_KEYS if k in row), None)
                if not isinstance(row.get("prompt"), str) or length is None:
                    raise ValueError(f"{fpath}:{n + 1}: needs 'prompt' and one of {_LEN_KEYS}")
                rows.append({
                    "id": str(row.get("id", f"{fpath.stem}:{n}" if len(files) > 1 else n)),
                    "prompt": row["prompt"],
                    "len": int(length),
                    "prompt_tokens": int(row.get("prompt_tokens", 0)),
                })
    plens = (
        token_lengths(tokenizer, [r["prompt"] for r in rows])
        if tokenizer is not None
        else [r["prompt_tokens"] for r in rows]
    )
    return [
        LengthPair(id=r["id"], prompt=r["prompt"], prompt_tokens=pl, response_len=max(1, r["len"]))
        for r, pl in zip(rows, plens)
    ]


def split_served(
    pairs: Sequence[LengthPair], holdout_fraction: float, seed: int = 0
) -> tuple[list[LengthPair], list[LengthPair]]:
    """(retrain, held-out) by prompt hash: deterministic and prompt-disjoint."""
    splits = split_pairs(
        [p.prompt for p in pairs], len(pairs), holdout_fraction, seed
    )
    train = [p.model_copy(update={"split": "train"}) for p, s in zip(pairs, splits) if s == "train"]
    test = [p.model_copy(update={"split": "test"}) for p, s in zip(pairs, splits) if s == "test"]
    return train, test


def is_validation_prompt(prompt: str, fraction: float, seed: int) -> bool:
    """Whether `prompt` falls in a validation slice of `fraction`, by prompt hash:
    a repeated prompt lands on one side only (a random slice would leak
    ShareGPT's re-posts across it and flatter the validation score)."""
    h = hashlib.sha256(f"{seed}\0val\0{prompt.strip()}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def split_validation(
    pairs: Sequence[LengthPair], fraction: float, seed: int
) -> tuple[list[LengthPair], list[LengthPair]]:
    """(fit, validation) of a training split, prompt-disjoint."""
    fit: list[LengthPair] = []
    val: list[LengthPair] = []
    for p in pairs:
        (val if is_validation_prompt(p.prompt, fraction, seed) else fit).append(p)
    return fit, val


def length_stats(pairs: Sequence[LengthPair]) -> dict[str, float]:
    xs = sorted(p.response_len for p in pairs)
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs),
        "median": xs[len(xs) // 2],
        "p90": xs[min(len(xs) - 1, math.floor(0.9 * len(xs)))],
    }


class Encoded(BaseModel):
    """Model inputs of a list of pairs: truncated ids, full prompt lengths, targets."""

    ids: list[list[int]]
    prompt_tokens: list[int]
    lengths: list[int]


def encode_pairs(
    tokenizer: Any, pairs: Sequence[LengthPair], head: int, tail: int, chat: bool = False
) -> Encoded:
    ids, _ = encode_prompts(tokenizer, [p.prompt for p in pairs], head, tail, chat)
    # `prompt_tokens` stays the dataset's count (the served model's tokenizer):
    # that is what the server knows about a request before it runs.
    return Encoded(
        ids=ids,
        prompt_tokens=[p.prompt_tokens for p in pairs],
        lengths=[p.response_len for p in pairs],
    )


def encode_pairs_for(tokenizer: Any, pairs: Sequence[LengthPair], cfg: ModelConfig) -> Encoded:
    """`encode_pairs` with the truncation and framing of `cfg`."""
    return encode_pairs(tokenizer, pairs, cfg.prompt_head, cfg.prompt_tail, cfg.prompt_format == "chat")
