"""Dataset building: split determinism, disjointness, exact sizes, served logs."""

from __future__ import annotations

import json
import random
from pathlib import Path

from predictor.config import DatasetConfig
from predictor.dataset import (
    LengthPair,
    build_pairs,
    encode_prompts,
    is_validation_prompt,
    load_tokenizer,
    read_served_completions,
    split_pairs,
    split_served,
    split_validation,
)

from .conftest import synthetic_records


def test_split_is_deterministic_exact_and_prompt_disjoint() -> None:
    rng = random.Random(1)
    prompts = [f"prompt {rng.randint(0, 400)}" for _ in range(1000)]  # many repeats
    a = split_pairs(prompts, n_finetune=300, test_fraction=0.3, seed=0)
    assert a == split_pairs(prompts, 300, 0.3, 0)  # same input, same split
    assert a.count("train") + a.count("test") == 300
    assert a.count("test") == 90 and a.count("train") == 210
    by_split: dict[str, set[str]] = {"train": set(), "test": set(), "serve": set()}
    for p, s in zip(prompts, a):
        by_split[s].add(p)
    assert not by_split["train"] & by_split["test"]
    assert not by_split["train"] & by_split["serve"]
    assert not by_split["test"] & by_split["serve"]
    # Independent of record order: a prompt keeps its split when records move.
    order = list(range(len(prompts)))
    rng.shuffle(order)
    b = split_pairs([prompts[i] for i in order], 300, 0.3, 0)
    assert all(b[j] == a[i] for j, i in enumerate(order))
    # Another seed gives another split.
    assert split_pairs(prompts, 300, 0.3, 1) != a


def test_validation_slice_keeps_repeated_prompts_together() -> None:
    assert is_validation_prompt("continue", 0.5, 0) == is_validation_prompt("  continue ", 0.5, 0)
    share = sum(is_validation_prompt(f"prompt {i}", 0.2, 0) for i in range(2000)) / 2000
    assert 0.15 < share < 0.25
    rng = random.Random(2)
    pairs = [LengthPair(id=str(i), prompt=f"q{rng.randint(0, 300)}", prompt_tokens=3, response_len=9)
             for i in range(1200)]
    fit, val = split_validation(pairs, 0.2, seed=0)
    assert len(fit) + len(val) == len(pairs) and val
    assert not {p.prompt for p in fit} & {p.prompt for p in val}
    # Another seed draws another slice.
    assert split_validation(pairs, 0.2, seed=1)[1] != val


def test_build_pairs_filters_and_splits(tiny_opt: Path) -> None:
    tok = load_tokenizer(str(tiny_opt))
    records = synthetic_records(200) + [("empty", "   ", "an answer here"), ("short", "hi", "ok")]
    cfg = DatasetConfig(tokenizer=str(tiny_opt), n_finetune=100, test_fraction=0.3,
                        min_response_tokens=4, max_response_tokens=100)
    s = build_pairs(records, tok, cfg)
    assert len(s.train) == 70 and len(s.test) == 30
    everything = s.train + s.test + s.serve
    ids = [p.id for p in everything]
    assert len(ids) == len(set(ids))
    assert "empty" not in ids and "short" not in ids  # empty prompt, 1-token answer
    assert all(4 <= p.response_len <= 100 for p in everything)
    one = next(p for p in everything if p.id == "r3")
    answer = dict((r[0], r[2]) for r in records)["r3"]
    assert one.response_len == len(tok(answer, add_special_tokens=False)["input_ids"])
    assert not {p.prompt for p in s.train} & {p.prompt for p in s.test}
    again = build_pairs(list(reversed(records)), tok, cfg)
    assert sorted(p.id for p in again.test) == sorted(p.id for p in s.test)


def test_encode_prompts_keeps_head_and_tail(tiny_opt: Path) -> None:
    tok = load_tokenizer(str(tiny_opt))
    text = " ".join(["sea"] * 5 + ["poem"] * 20 + ["hi"] * 3)
    full = tok(text, add_special_tokens=False)["input_ids"]
    ids, lens = encode_prompts(tok, [text, ""], head=4, tail=2)
    assert lens == [len(full), 0]
    assert ids[0] == full[:4] + full[-2:]
    assert len(ids[1]) == 1  # an empty prompt still gets one token


def test_served_completions_roundtrip(tmp_path: Path, tiny_opt: Path) -> None:
    path = tmp_path / "served.jsonl"
    rows = [{"prompt": f"write a poem {i}", "output_len": 10 + i} for i in range(40)]
    rows.append({"prompt": "hi", "completion_tokens": 5, "id": "x"})
    # Cut by max_tokens: not an answer length (deployments/served_log.py).
    rows.append({"prompt": "tell me everything", "output_len": 16, "censored": True})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pairs = read_served_completions(path, load_tokenizer(str(tiny_opt)))
    assert len(pairs) == 41 and pairs[-1].response_len == 5 and pairs[-1].id == "x"
    assert all(p.prompt_tokens > 0 for p in pairs)
    tr, ho = split_served(pairs, 0.25)
    assert len(ho) == 10 and len(tr) == 31
    assert not {p.prompt for p in tr} & {p.prompt for p in ho}
    assert split_served(pairs, 0.25) == (tr, ho)
