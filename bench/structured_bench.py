"""What structured output costs a decode step: the grammar's share of the
host time, beside the sampling it constrains, in one run.

Each of `--batch` requests follows a JSON Schema (xgrammar's matcher over
SmolLM2's tokenizer) along the tokens of a valid document; per step this
times, with the engine's own code: the matchers accepting their last token
and writing the next allowed set (`RequestGrammar.advance` / `fill`), and
greedy sampling of random logits with those masks applied against the
same sampling without them, where the rows' favourite token is one the
grammar allows (`--agree 1`: what a model that follows the schema gives)
and where it is not (`--agree 0`: random logits).  Also the schema's first compile and a cached
one.  A decode step of the whole model is `python -m bench.step_profile`.

    python -m bench.structured_bench --out studies/structured/overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.report import machine_meta, write_report
from engine.model_source import resolve_model
from engine.sampling import SampleRequest, Sampler, SamplingParams
from engine.sampling_params import StructuredOutput
from engine.structured import GrammarCompiler
from engine.tokenizer import eos_token_ids, load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                      "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}}


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def measure(batch: int, steps_cap: int, model: str, agree: float) -> dict[str, object]:
    from transformers import AutoConfig

    path = resolve_model(model)
    tok = load_tokenizer(path)
    vocab = AutoConfig.from_pretrained(path, local_files_only=True).vocab_size
    eos = eos_token_ids(path, tok, AutoConfig.from_pretrained(path, local_files_only=True))
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, vocab, eos)
    # The tokenizer's grammar table, built on first use (with a trivial regex).
    compiler.prepare(StructuredOutput(kind="regex", spec="a"))
    tokenizer_info_s = time.perf_counter() - t0
    so = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA))
    t0 = time.perf_counter()
    compiler.start(so)
    first_compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.start(so)
    cached_compile_s = time.perf_counter() - t0

    doc = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    steps = min(steps_cap, len(doc))
    grammars = [compiler.start(so) for _ in range(batch)]
    params = SamplingParams(temperature=0.0, structured=so)
    plain_params = SamplingParams(temperature=0.0)
    sampler = Sampler(seed=0)
    gen = torch.Generator().manual_seed(0)
    grammar_s: list[float] = []
    masked_s: list[float] = []
    plain_s: list[float] = []
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=gen) * 3
        if step < len(doc):
            # These rows' favourite token is the document's next, one the
            # grammar allows (a model that writes what the schema asks).
            logits[: round(agree * batch), doc[step]] += 20.0
        t0 = time.perf_counter()
        bitmask = compiler.bitmask(batch)
        for row, g in enumerate(grammars):
            g.advance(doc[:step])
            g.fill(bitmask, row)
        grammar_s.append(time.perf_counter() - t0)
        masked = [SampleRequest(params, step, allowed=bitmask[r]) for r in range(batch)]
        plain = [SampleRequest(plain_params, step) for _ in range(batch)]
        t0 = time.perf_counter()
        picked = sampler.sample(logits, masked)
        masked_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sampler.sample(logits, plain)
        plain_s.append(time.perf_counter() - t0)
        # Every masked pick is a token the grammar allows there.
        allowed = (bitmask[0, picked[0] // 32] >> (picked[0] % 32)) & 1
        assert int(allowed) == 1, (step, picked[0])
    return {
        "batch": batch, "agree": agree, "steps": steps, "tokenizer_info_s": round(tokenizer_info_s, 3),
        "first_compile_ms": round(first_compile_s * 1000, 2),
        "cached_compile_ms": round(cached_compile_s * 1000, 3),
        "grammar_ms_per_step": _ms(grammar_s), "masked_sampling_ms_per_step": _ms(masked_s),
        "plain_sampling_ms_per_step": _ms(plain_s),
        "added_ms_per_step": round(_ms(grammar_s) + _ms(masked_s) - _ms(plain_s), 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.structured_bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8,32,96", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed (at most the "
                    "document's tokens)")
    ap.add_argument("--agree", default="1,0", help="comma-separated fractions of the rows "
                    "whose favourite token the grammar allows (the rest: random logits, "
                    "whose favourite it nearly always refuses)")
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    results = []
    for agree in (float(x) for x in a.agree.split(",") if x):
        for b in (int(x) for x in a.batch.split(",") if x):
            r = measure(b, a.steps, a.model, agree)
            print(json.dumps(r), flush=True)
            results.append(r)
    meta = {**machine_meta(), "threads": a.threads, "model": a.model,
            "schema": SCHEMA, "document": DOCUMENT}
    write_report({"meta": meta, "results": results}, a.out)


if __name__ == "__main__":
    main()
