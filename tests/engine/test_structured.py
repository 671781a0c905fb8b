"""Structured output through the runner and the scheduler core: the real
SmolLM2 model's output follows its grammar (JSON Schema, JSON object,
regex, choice), ends with "stop" at the grammar's end, and is the same
with preemption and recomputation in between (float32)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.structured import GrammarCompiler, mask_logits
from engine.tokenizer import encode_chat
from tests.engine.helpers import drive

xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"], "additionalProperties": False,
}
CHOICES = ["yes", "no", 'it "depends" \\ à']


@pytest.fixture(scope="module")
def runner(smollm2_path: Path) -> ModelRunner:
    return ModelRunner(smollm2_path, "float32", "cpu", num_blocks=96, block_size=4,
                       max_model_len=128, num_threads=1)


def _chat(runner: ModelRunner, text: str) -> list[int]:
    return encode_chat(runner.tokenizer, [{"role": "user", "content": text}])


def _requests(runner: ModelRunner) -> tuple[dict[str, list[int]], dict[str, SamplingParams]]:
    prompts = {
        "schema": _chat(runner, "Give me a person as JSON with a name and an age."),
        "choice": _chat(runner, "Is the sky blue? Answer yes or no."),
        "regex": _chat(runner, "What is 12 times 3?"),
        "object": _chat(runner, "Describe a cat."),
        "free": _chat(runner, "Say hello."),
    }
    params = {
        "schema": SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutput(
            kind="json_schema", spec=json.dumps(SCHEMA))),
        "choice": SamplingParams(temperature=0.0, max_tokens=20, structured=StructuredOutput(
            kind="choice", choices=CHOICES)),
        "regex": SamplingParams(temperature=0.0, max_tokens=20, structured=StructuredOutput(
            kind="regex", spec=r"answer: [0-9]{1,3}")),
        # Sampled, seeded: the mask holds under temperature too.
        "object": SamplingParams(temperature=0.9, seed=3, max_tokens=40,
                                 structured=StructuredOutput(kind="json_object")),
        # Long enough that its growth preempts a structured request.
        "free": SamplingParams(temperature=0.0, max_tokens=40),
    }
    return prompts, params


def _check(res_text: dict[str, str], finish: dict[str, str | None]) -> None:
    person = json.loads(res_text["schema"])
    assert set(person) == {"name", "age"} and isinstance(person["name"], str)
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
    assert finish["schema"] == "stop"
    assert res_text["choice"] in CHOICES and finish["choice"] == "stop"
    assert re.fullmatch(r"answer: [0-9]{1,3}", res_text["regex"]) and finish["regex"] == "stop"
    if finish["object"] == "stop":
        assert isinstance(json.loads(res_text["object"]), dict)
    else:  # cut by max_tokens: a prefix of a JSON object
        assert finish["object"] == "length" and res_text["object"].lstrip().startswith("{")


def test_outputs_follow_their_grammars_through_preemption(runner: ModelRunner) -> None:
    prompts, params = _requests(runner)
    alone = drive(runner, prompts, params, num_blocks=96, block_size=4, max_model_len=128)
    _check(alone.text, alone.finish)
    # The unconstrained request is not held to any grammar.
    assert not alone.text["free"].startswith("{")
    tight = drive(runner, prompts, params, num_blocks=28, block_size=4, max_model_len=96,
                  max_batch_tokens=64)
    assert tight.num_mid_generation_preemptions > 0
    assert tight.tokens == alone.tokens


def test_a_resumed_request_replays_its_outputs(runner: ModelRunner) -> None:
    prompts, params = _requests(runner)
    done = drive(runner, {"schema": prompts["schema"]}, params["schema"], num_blocks=96,
                 block_size=4, max_model_len=128)
    tokens = done.tokens["schema"]
    assert runner.grammars is not None
    grammar = runner.grammars.start(params["schema"].structured, tokens[:5])
    assert grammar.accepted == 5
    bitmask = runner.grammars.bitmask(1)
    assert grammar.fill(bitmask, 0)
    logits = torch.zeros(1, runner.vocab_size)
    mask_logits(logits, bitmask)
    assert logits[0, tokens[5]] == 0.0  # the next output is still allowed
    # Outputs that break the grammar are refused, not followed blindly.
    text_ids = runner.tokenizer.encode("not json")
    with pytest.raises(ValueError, match="outside the request's grammar"):
        runner.grammars.start(params["schema"].structured, text_ids)


def test_a_grammar_that_does_not_compile_is_refused(runner: ModelRunner) -> None:
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput(kind="regex", spec="(ab"))
    with pytest.raises(ValueError, match="regex does not compile"):
        runner.add_request("bad", bad, [1, 2, 3])
    assert not runner.has_request("bad")


def test_structured_output_needs_eos() -> None:
    so = StructuredOutput(kind="json_object")
    for extra in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ValueError, match="structured output ends at EOS"):
            SamplingParams(structured=so, **extra)  # type: ignore[arg-type]


def test_the_mask_bans_exactly_the_clear_bits(runner: ModelRunner) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0
    bitmask[1, 5] = 1 << 7  # token 167 alone
    logits = torch.randn(3, vocab, generator=gen)
    masked = logits.clone()
    mask_logits(masked, bitmask, [0, 1])
    token = torch.arange(vocab)
    bit = (bitmask[:, token // 32].to(torch.int64) >> (token % 32)) & 1
    for row in (0, 1):
        allowed = bit[row].bool()
        assert torch.equal(masked[row][allowed], logits[row][allowed])
        assert bool(torch.isneginf(masked[row][~allowed]).all())
    assert torch.isneginf(masked[1]).sum() == vocab - 1 and masked[1, 167] == logits[1, 167]
    assert torch.equal(masked[2], logits[2])  # not among the rows


def test_choices_with_quotes_and_backslashes_compile(runner: ModelRunner) -> None:
    compiler = GrammarCompiler(runner.tokenizer, runner.vocab_size, runner.eos_token_ids)
    grammar = compiler.start(StructuredOutput(kind="choice", choices=CHOICES),
                             runner.tokenizer.encode(CHOICES[2]))
    assert grammar.accepted == len(runner.tokenizer.encode(CHOICES[2]))


def test_a_prepared_grammar_is_found_compiled(runner: ModelRunner) -> None:
    compiler = GrammarCompiler(runner.tokenizer, runner.vocab_size, runner.eos_token_ids,
                               cache_size=2)
    so = StructuredOutput(kind="regex", spec="[a-c]{2}")
    assert not compiler.cached(so)
    compiler.prepare(so)  # what the replica runs off the loop's thread
    assert compiler.cached(so)
    grammar = compiler.start(so, runner.tokenizer.encode("ab"))
    assert grammar.accepted == len(runner.tokenizer.encode("ab"))
    # A structure that does not compile is left for `start` to refuse.
    bad = StructuredOutput(kind="grammar", spec="root ::= ")
    compiler.prepare(bad)
    assert not compiler.cached(bad)
    with pytest.raises(ValueError, match="grammar does not compile"):
        compiler.start(bad)
    # The cache is bounded: the least recently used grammar goes first.
    others = [StructuredOutput(kind="choice", choices=(c,)) for c in ("x", "y")]
    for other in others:
        compiler.prepare(other)
    assert not compiler.cached(so) and all(compiler.cached(o) for o in others)


def test_open_rows_are_those_that_allow_every_token() -> None:
    from engine.structured import open_rows

    vocab = 100  # three full words and 4 bits of a fourth
    bitmask = torch.full((4, 4), -1, dtype=torch.int32)
    bitmask[1, 2] = ~(1 << 5)  # token 69 refused
    bitmask[2, 3] = 0b1111  # bits past the vocabulary clear: still open
    bitmask[3, 3] = 0b0111  # token 99 refused
    assert open_rows(bitmask, vocab) == [True, False, True, False]
    assert open_rows(bitmask[:, :3], 96) == [True, False, True, True]
