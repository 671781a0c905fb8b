"""Hypothesis strategies for requests a hostile or careless client may send.

Field names come from the request models themselves, so a field added to
`api/protocol.py` is fuzzed with no edit here.  Values are of every JSON
type: null, booleans, ints far beyond 64 bits, floats, strings with control
characters and lone surrogates, nested lists and objects.  Requests are
built around a valid one, so many are served and the response side is
exercised too.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from api.chat_messages import ChatMessage, ContentPart
from api.protocol import ChatCompletionRequest, CompletionRequest

VOCAB = 49152  # SmolLM2's tokenizer
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

REQUEST_FIELDS = sorted(set(CompletionRequest.model_fields)
                        | set(ChatCompletionRequest.model_fields))
NESTED_FIELDS = sorted(set(ChatMessage.model_fields) | set(ContentPart.model_fields)
                       | {"include_usage", "continuous_usage_stats"})
KEYS = st.one_of(st.sampled_from(REQUEST_FIELDS), st.sampled_from(NESTED_FIELDS),
                 st.sampled_from(["", "Prompt", "max_tokens ", "__proto__", "0"]),
                 st.text(max_size=6))

_SPECIAL_CHARS = ["\x00", "\x1b", "\x7f", "\u2028", "\ufeff", "\ud800", "\udbff\udc00",
                  "\udfff", "\U0001f600", "\u0301", "<|im_end|>", "<|im_start|>", "\\"]
TEXT = st.lists(st.one_of(st.characters(), st.sampled_from(_SPECIAL_CHARS)),
                max_size=8).map("".join)

_EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63),
              -(2**63) - 1, 2**64, 10**30, 2**70, -(10**30), VOCAB, VOCAB - 1]
INTS = st.one_of(st.integers(-3, 40), st.sampled_from(_EDGE_INTS),
                 st.integers(-(2**80), 2**80))
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, -0.0, 1e-320, 1e308, -1e308, 0.5, 2.0000001]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
WILD = st.recursive(
    SCALARS,
    lambda kids: st.one_of(st.lists(kids, max_size=4),
                           st.dictionaries(KEYS, kids, max_size=4)),
    max_leaves=8,
)

_TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "bot"]),
     "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2))},
    optional={"name": TEXT, "tool_calls": st.one_of(st.none(), st.just([]), WILD)},
)

# Values a client plausibly sends for the fields we know of; any other
# field (a new one included) gets values from WILD.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([None, "smollm2", "gpt-4", ""]),
    "prompt": st.one_of(TEXT.filter(bool), _TOKEN_IDS, st.lists(TEXT, min_size=1, max_size=3),
                        st.lists(_TOKEN_IDS, min_size=1, max_size=3)),
    "messages": st.lists(_MESSAGE, min_size=1, max_size=3),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 4),
    "n": st.integers(1, 4),
    "best_of": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 60),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "echo": st.booleans(),
    "logprobs": st.one_of(st.integers(0, 5), st.booleans()),
    "top_logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB + 5).map(str), st.floats(-100, 100),
                                  max_size=3),
    "priority": st.integers(-5, 5),
    "user": TEXT,
    "job_class": st.sampled_from(["online", "offline", "batch"]),
}


def field_value(name: str) -> st.SearchStrategy[Any]:
    plausible = PLAUSIBLE.get(name)
    if plausible is None:  # mostly the fields we refuse unless "off" (null)
        return st.one_of(st.none(), WILD)
    return st.one_of(plausible, plausible, plausible, WILD)


# Mostly the fields we serve, so that a good share of requests is served
# and the response side is fuzzed too; any field now and then.
_MUTATED_FIELDS = st.one_of(st.sampled_from(sorted(PLAUSIBLE)), st.sampled_from(sorted(PLAUSIBLE)),
                            st.sampled_from(sorted(PLAUSIBLE)), st.sampled_from(REQUEST_FIELDS))


@st.composite
def mutated_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request of either endpoint with a few fields set to drawn values."""
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    if path == COMPLETIONS:
        body: dict[str, Any] = {"prompt": "Hello there", "max_tokens": 3}
    else:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    for name in draw(st.lists(_MUTATED_FIELDS, max_size=4, unique=True)):
        body[name] = draw(field_value(name))
    if draw(st.integers(0, 4)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))))
    return path, body


def encode(body: Any, ascii_only: bool) -> bytes:
    """JSON bytes; non-ASCII output writes lone surrogates raw, which makes
    the body invalid UTF-8 (a case of its own)."""
    if ascii_only:
        return json.dumps(body, ensure_ascii=True).encode("ascii")
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


_FRAGMENTS = [b"{", b"}", b"[", b"]", b'"', b":", b",", b"NaN", b"Infinity", b"-Infinity",
              b"1e999", b"null", b'"\\ud800"', b"\xff", b"\xed\xa0\x80", b"\xef\xbb\xbf",
              b'"prompt"', b'"messages"', b"9" * 40, b"\\", b"\x00", b" "]
RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.lists(st.sampled_from(_FRAGMENTS), max_size=24).map(b"".join),
    st.integers(1, 2000).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}"),
)

CONTENT_TYPES = st.one_of(
    st.none(),
    st.sampled_from(["application/json", "application/json; charset=utf-8",
                     "application/vnd.x+json", "text/plain", "application/x-www-form-urlencoded",
                     "multipart/form-data", "", "*/*", "application/json, text/plain",
                     "application/JSON;charset=\"x\"", "+json"]),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=30),
)
METHODS = st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
_SEGMENTS = st.sampled_from(["v1", "completions", "chat", "models", "health", "openapi.json",
                             "", ".", "..", "%00", "%2F", "v2", "smollm2", "\u00e9", "a b"])
PATHS = st.one_of(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                     "/openapi.json", "/"]),
    st.lists(_SEGMENTS, min_size=1, max_size=4).map(lambda s: "/" + "/".join(s)),
)
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e),
                      max_size=40)
