"""Structured output: constrained decoding with xgrammar.

A request with a grammar (`SamplingParams.structured`: a JSON object, a
JSON Schema, a regular expression, a choice of strings, an EBNF grammar, an
xgrammar structural tag) gets a matcher that follows its output token by
token.  Before each of its tokens is sampled the matcher writes the set of
tokens that keep the text inside the grammar as a bitmask (one bit per
vocabulary entry), and every other logit becomes -inf (`mask_logits`),
ahead of bias, penalties, temperature, top-k and top-p, as vLLM applies its
grammar bitmask.  Once the grammar is complete only its stop tokens (the
model's EOS) are allowed, so the request ends with finish reason "stop";
`max_tokens` can still cut it short ("length"), as with OpenAI.

The matcher lives with the request's engine state, so it survives
preemption with the outputs it has accepted; a request resumed on another
replica (migration) replays its outputs into a new matcher.  A grammar
compiles once per replica, in a worker thread before its request reaches
the engine's loop (`GrammarCompiler.prepare`): ~10 ms for a small schema
on a CPU core, seconds for a large one, which the running requests must
not wait for.  xgrammar is imported on the first structured request only.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from engine.sampling_params import StructuredOutput

__all__ = ["GrammarCompiler", "RequestGrammar", "check_structured", "choice_grammar",
           "mask_logits", "open_rows"]


# OpenAI's `json_object`: a JSON object, not any JSON value (xgrammar's
# built-in JSON grammar also takes arrays and scalars).
_ANY_OBJECT = '{"type": "object"}'
# "[23:32:14] /project/cpp/regex_converter.cc:94: " before xgrammar's message.
_WHERE = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string
    literals are xgrammar's EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(xgr: Any, so: StructuredOutput) -> Any:
    """The structure as an xgrammar `Grammar`: what the ingress checks (no
    tokenizer needed) and what a replica compiles."""
    if so.kind == "json_object":
        return xgr.Grammar.from_json_schema(_ANY_OBJECT)
    if so.kind == "json_schema":
        return xgr.Grammar.from_json_schema(so.spec)
    if so.kind == "regex":
        return xgr.Grammar.from_regex(so.spec)
    if so.kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(so.choices or []))
    if so.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(so.spec)
    return xgr.Grammar.from_ebnf(so.spec)


def check_structured(so: StructuredOutput) -> str | None:
    """Why xgrammar cannot build this structure (its message), or None."""
    import xgrammar as xgr

    try:
        _grammar(xgr, so)
    except (RuntimeError, ValueError, TypeError) as e:
        return _message(e)
    return None


def _message(e: Exception) -> str:
    """xgrammar's message without its time stamp and source position."""
    text = str(e).strip()
    return _WHERE.sub("", text.splitlines()[-1]) if text else type(e).__name__


class RequestGrammar:
    """One request's matcher and how many of its outputs it has accepted."""

    __slots__ = ("matcher", "accepted")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.accepted = 0

    def advance(self, outputs: Sequence[int]) -> None:
        """Accept the outputs not yet accepted.  Each was sampled under this
        grammar's mask (or, resumed, under the same grammar elsewhere)."""
        for token in outputs[self.accepted:]:
            if not self.matcher.accept_token(token):
                raise ValueError(f"token {token} (output {self.accepted}) is outside "
                                 "the request's grammar")
            self.accepted += 1

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed tokens into `bitmask[row]`; False (row left
        as it is) once the grammar has ended: its stop token was sampled,
        and the request is over."""
        if self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True


class GrammarCompiler:
    """A replica's grammars over its tokenizer and vocabulary: compiled
    once each (a bounded cache) and a matcher per request.

    Compiling is the costly part (a large schema takes seconds on a CPU
    core), so the replica compiles a request's grammar in a worker thread
    before the request reaches the engine's loop (`prepare`, which
    xgrammar runs without the GIL); the loop's `start` then finds it here
    and every running request keeps its pace.  xgrammar's tokenizer table
    is built on first use (0.2-0.45 s for SmolLM2's 49k tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self.cache_size = cache_size

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop)
                # Our cache is the bounded one; one thread per compile.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def cached(self, so: StructuredOutput) -> bool:
        with self._lock:
            return so in self._compiled

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar (ValueError if it does not compile)."""
        with self._lock:
            compiled = self._compiled.get(so)
            if compiled is not None:
                self._compiled.move_to_end(so)
                return compiled
        c = self._xgrammar_compiler()
        import xgrammar as xgr

        try:
            compiled = c.compile_grammar(_grammar(xgr, so))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{so.kind} does not compile: {_message(e)}") from None
        with self._lock:
            self._compiled[so] = compiled
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    def prepare(self, so: StructuredOutput) -> None:
        """Compile `so` ahead of its request (any thread).  A structure that
        does not compile is left for `start` to refuse with the request."""
        try:
            self.compile(so)
        except ValueError:
            pass

    def start(self, so: StructuredOutput, outputs: Sequence[int] = ()) -> RequestGrammar:
        """A matcher for a new request, past `outputs` if it resumes.
        ValueError for a structure that does not compile or outputs
        outside it."""
        import xgrammar as xgr

        grammar = RequestGrammar(xgr.GrammarMatcher(self.compile(so)))
        grammar.advance(outputs)
        return grammar

    def bitmask(self, rows: int) -> torch.Tensor:
        """An int32 `[rows, ceil(vocab / 32)]` bitmask, every token allowed."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)


def open_rows(bitmask: torch.Tensor, vocab_size: int) -> list[bool]:
    """Per row of `bitmask`, whether it allows every token of the
    vocabulary: a row that does (free text before a tool call, under
    `tool_choice: auto`) samples as if it had no grammar, without the mask
    (~0.15-0.2 ms a row on a CPU core)."""
    full, rest = divmod(vocab_size, 32)
    out = (bitmask[:, :full] == -1).all(dim=1)
    if rest:
        tail = (1 << rest) - 1
        out &= (bitmask[:, full] & tail) == tail
    return out.tolist()


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor,
                rows: list[int] | None = None) -> None:
    """Set to -inf, in place, each float32 logit whose bit in `bitmask` is
    clear, in `rows` only if given.  `bitmask` `[rows, words]` int32, row-
    aligned with `logits`, token `32 * w + b` at bit `b` of word `w`
    (xgrammar's layout), on any device.  xgrammar's own kernel
    (C++ on a CPU, CUDA or Triton on a GPU): about 0.15-0.2 ms a row of
    SmolLM2's 49k logits on one CPU core, about what the vectorised torch
    versions tried cost on grammar masks, and 2x faster on dense ones."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=rows)
