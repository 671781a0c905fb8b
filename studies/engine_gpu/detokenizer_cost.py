"""Host µs a token of the engine's text decoding (`IncrementalDetokenizer`),
against the tokenizer library's `DecodeStream` alone, by answer length.

The serving loop decodes every sampled token's text on its own thread; on
a GPU that is host work beside every few-ms step.  This feeds the embedded
model's tokenizer answers of `--lengths` tokens (cut from a long English
text, the repository's README, and drawn at random from the vocabulary,
where more tokens complete no character), a fresh detokenizer per answer,
with no stop strings and with two, and times µs a token, the median of
`--rounds`:

    python -m studies.engine_gpu.detokenizer_cost --lengths 256,1024,4096 \\
        --out studies/engine_gpu/detokenizer/<name>.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from engine.detokenizer import IncrementalDetokenizer
from engine.model_source import resolve_model
from engine.tokenizer import load_tokenizer

STOPS = ("###", "\n\n\n")
PROMPT = [1, 2, 3, 4]


def _answers(ids: list[int], length: int) -> list[list[int]]:
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]


def _per_token(answers: list[list[int]], feed: Any) -> float:
    n = sum(len(a) for a in answers)
    t0 = time.perf_counter()
    for a in answers:
        feed(a)
    return 1e6 * (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,1024,4096")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    tok = load_tokenizer(resolve_model("embedded:smollm2"))
    backend = tok._tokenizer
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    text_ids = tok.encode(readme, add_special_tokens=False)[:16384]
    rng = random.Random(0)
    random_ids = [rng.randrange(10, tok.vocab_size) for _ in range(len(text_ids))]

    def stream(answer: list[int]) -> None:
        ds = DecodeStream(ids=PROMPT, skip_special_tokens=True)
        for t in answer:
            ds.step(backend, t)

    def detok(stop: tuple[str, ...]) -> Any:
        def feed(answer: list[int]) -> None:
            d = IncrementalDetokenizer(tok, PROMPT, stop=stop)
            for t in answer:
                d.add_token(t, check_stop=False)
        return feed

    ways = {"decode_stream": stream, "detokenizer": detok(()), "detokenizer_stops": detok(STOPS)}
    rows = []
    for kind, ids in (("text", text_ids), ("random", random_ids)):
        for length in (int(x) for x in a.lengths.split(",")):
            answers = _answers(ids, length)
            times: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(a.rounds):
                for w, feed in ways.items():
                    times[w].append(_per_token(answers, feed))
            row = {"tokens": kind, "answer_length": length, "answers": len(answers),
                   **{f"{w}_us": round(statistics.median(v), 3) for w, v in times.items()}}
            rows.append(row)
            print(row)
    doc = {"command": "python -m studies.engine_gpu.detokenizer_cost "
           + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
           "stops": list(STOPS), "rounds": a.rounds, "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
