"""What a tool-calling grammar costs the matchers per decode step, beside a
JSON Schema's.

Under `tool_choice: auto` every token a request generates goes through its
matcher, words included, so the matcher's share of a step is what tools
add to an answer that calls nothing.  Each of `--batch` matchers follows
the same text (the engine's own `RequestGrammar.advance` / `fill`); per
step this times them all, for:

- `json`: `bench/structured_bench.py`'s schema along its document;
- `auto_words`: two tools' `auto` grammar along an answer in words;
- `auto_call`: the same grammar along a sentence, then a call;
- `required`: `required` along two calls;

and the share of rows the grammar leaves open (every token allowed, which
then sample as free rows), and what sampling such rows costs with the mask
applied against as free rows.

    python -m studies.structured.tool_grammar --out studies/structured/tool_grammar.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from api.tools import ToolDefinition, ToolUse
from bench.report import machine_meta, write_report
from bench.structured_bench import DOCUMENT, SCHEMA
from engine.model_source import resolve_model
from engine.sampling_params import StructuredOutput
from engine.sampling import SampleRequest, Sampler, SamplingParams
from engine.structured import GrammarCompiler, open_rows
from engine.tokenizer import eos_token_ids, load_tokenizer

TOOLS = tuple(ToolDefinition.model_validate(t) for t in (
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "required": ["tz"],
                       "properties": {"tz": {"type": "string"}}}}}))
WORDS = ("The weather in Paris this week is mild: around 18 degrees in the afternoon, "
         "cooler at night, with some rain on Thursday. Take a light jacket and an "
         "umbrella if you go out in the evening.")
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
        '\n</tool_call>')
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>'


def cases() -> dict[str, tuple[StructuredOutput, str]]:
    auto = ToolUse(TOOLS, "auto").structure()
    return {
        "json": (StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA)),
                 json.dumps(DOCUMENT)),
        "auto_words": (auto, WORDS),
        "auto_call": (auto, "Let me check that for you.\n" + CALL),
        "required": (ToolUse(TOOLS, "required").structure(), CALL + "\n" + TIME_CALL),
    }


def measure(compiler: GrammarCompiler, tok: object, so: StructuredOutput, text: str,
            batch: int) -> dict[str, float | int]:
    ids = tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    compiler.compile(so)
    compile_ms = (time.perf_counter() - t0) * 1000
    grammars = [compiler.start(so) for _ in range(batch)]
    bitmask = compiler.bitmask(batch)
    per_step: list[float] = []
    opened: list[float] = []
    for step in range(len(ids)):
        t0 = time.perf_counter()
        for row, g in enumerate(grammars):
            g.advance(ids[:step])
            g.fill(bitmask, row)
        per_step.append(time.perf_counter() - t0)
        opened.append(statistics.fmean(open_rows(bitmask, compiler.vocab_size)))
        assert (int(bitmask[0, ids[step] // 32]) >> (ids[step] % 32)) & 1, step
    return {"batch": batch, "tokens": len(ids), "first_compile_ms": round(compile_ms, 2),
            "matchers_ms_per_step": round(statistics.median(per_step) * 1000, 3),
            "matchers_ms_per_step_p90": round(
                statistics.quantiles(per_step, n=10)[8] * 1000, 3),
            "open_rows_share": round(statistics.fmean(opened), 3)}


def sampling(compiler: GrammarCompiler, batch: int, steps: int = 30) -> dict[str, float]:
    """Sampling (temperature 1) of `batch` rows whose grammar leaves them
    open, with the all-allowed mask applied as before rows were told apart,
    and as free rows, as now."""
    vocab = compiler.vocab_size
    params = SamplingParams(temperature=1.0, seed=0)
    bitmask = compiler.bitmask(batch)
    gen = torch.Generator().manual_seed(0)
    masked_s: list[float] = []
    free_s: list[float] = []
    sampler = Sampler(seed=0)
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=gen) * 3
        masked = [SampleRequest(params, step, allowed=bitmask[r]) for r in range(batch)]
        free = [SampleRequest(params, step) for _ in range(batch)]
        t0 = time.perf_counter()
        a = sampler.sample(logits.clone(), masked)
        masked_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = sampler.sample(logits.clone(), free)
        free_s.append(time.perf_counter() - t0)
        assert a == b  # the same draws: an all-allowed mask changes nothing
    return {"batch": batch, "masked_ms_per_step": round(statistics.median(masked_s) * 1000, 3),
            "free_ms_per_step": round(statistics.median(free_s) * 1000, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.structured.tool_grammar",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,32,96")
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoConfig

    path = resolve_model(a.model)
    tok = load_tokenizer(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    compiler = GrammarCompiler(tok, config.vocab_size, eos_token_ids(path, tok, config))
    compiler.prepare(StructuredOutput(kind="regex", spec="a"))  # the tokenizer's table
    results = []
    for name, (so, text) in cases().items():
        for b in (int(x) for x in a.batch.split(",") if x):
            r = {"case": name, **measure(compiler, tok, so, text, b)}
            print(json.dumps(r), flush=True)
            results.append(r)
    open_sampling = []
    for b in (int(x) for x in a.batch.split(",") if x):
        r = sampling(compiler, b)
        print(json.dumps(r), flush=True)
        open_sampling.append(r)
    write_report({"meta": {**machine_meta(), "model": a.model}, "results": results,
                  "open_rows_sampling": open_sampling}, a.out)


if __name__ == "__main__":
    main()
