"""OpenAI responses assembled from the engine's per-choice deltas.

One `ResponseBuilder` per HTTP request.  The engine streams
`GenerateDelta`s per prompt of the request, each tagged with its choice's
index among that prompt's `n`; here they become OpenAI choices, indexed
prompt-major (choice = prompt * n + index) as OpenAI indexes a batch, then
either stream chunks or one final response.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api.logprobs import Entry, TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from api.protocol import PromptTokensDetails, Usage, WireLogprob
from api.reasoning import ReasoningFormat, ReasoningParser, ReasoningTally, split_reasoning
from api.tool_parser import ToolCallParser
from api.tools import ToolUse


@dataclass(slots=True)
class PromptInput:
    token_ids: list[int]
    # What `echo` returns: the prompt string, or the decoded token ids.
    text: str

    def keep_last(self, k: int, decode: Callable[[list[int]], str]) -> None:
        """vLLM's `truncate_prompt_tokens`: only the last `k` tokens stay
        (and what echo returns is their text)."""
        if 0 < k < len(self.token_ids):
            self.token_ids = self.token_ids[-k:]
            if self.text:
                self.text = decode(self.token_ids)


@dataclass(slots=True)
class _Choice:
    index: int
    prompt: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[Entry] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: dict[str, Any] | None = None
    started: bool = False
    text_offset: int = 0
    last_token: int | None = None
    # Splits a chat answer into content and tool calls (tools offered).
    parser: ToolCallParser | None = None
    # The parser has read the whole answer (streamed, as it came).
    parsed: bool = False
    # vLLM's: the stop string or stop token id that ended it.
    stop_reason: str | int | None = None
    # Its token ids (kept with `return_token_ids`), and how many of them a
    # stream has sent.
    ids: list[int] = field(default_factory=list)
    ids_sent: int = 0
    prompt_ids_sent: bool = False
    # Splits a reasoning model's answer (`reasoning_parser`) as it streams.
    reasoner: ReasoningParser | None = None
    # Its reasoning tokens so far, for the usage (on every chunk with
    # `continuous_usage_stats`).
    tally: ReasoningTally | None = None


class ResponseBuilder:
    def __init__(self, request_id: str, model: str, created: int, chat: bool,
                 prompts: list[PromptInput], n: int, tokens: TokenText,
                 logprobs: bool = False, echo: bool = False,
                 prompt_logprobs: bool = False, tools: ToolUse | None = None,
                 token_ids: bool = False, logprob_ids: bool = False,
                 reasoning: ReasoningFormat | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.chat = chat
        self.prompts = prompts
        self.n = n
        self.tokens = tokens
        self.want_logprobs = logprobs
        self.echo = echo and not chat
        self.choices = [_Choice(p * n + i, p) for p in range(len(prompts)) for i in range(n)]
        if tools is not None and chat:
            for c in self.choices:
                c.parser = ToolCallParser(tools)
        # vLLM's `prompt_logprobs`, per prompt, from its first choice that has them.
        self.want_prompt_logprobs = prompt_logprobs
        self.prompt_logprobs: list[list[dict[str, Any] | None] | None] = [None] * len(prompts)
        # vLLM's `continuous_usage_stats`: the usage so far on every chunk.
        self.continuous_usage = False
        # vLLM's `return_token_ids` and `return_tokens_as_token_ids`.
        self.want_token_ids = token_ids
        self.logprob_ids = logprob_ids
        # A chat answer's reasoning, apart from its content (api/reasoning.py);
        # its tokens are kept to count the reasoning's.
        self.reasoning = reasoning if chat else None
        if self.reasoning is not None:
            for c in self.choices:
                c.reasoner = ReasoningParser(self.reasoning)
                c.tally = ReasoningTally(self.reasoning)
        self.keep_ids = token_ids or self.reasoning is not None

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        # Each prompt counts once, as in prompt_tokens: what its choices
        # found cached at most (a sibling reads its leader's prompt KV).
        cached = sum(max((c.metrics or {}).get("cached_tokens", 0)
                         for c in self.choices if c.prompt == p)
                     for p in range(len(self.prompts)))
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion,
                      total_tokens=prompt + completion,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=cached)
                      ).model_dump()
        predicted = [c.metrics for c in self.choices
                     if c.metrics and c.metrics.get("accepted_prediction_tokens") is not None]
        if predicted:  # OpenAI's Predicted Outputs
            usage["completion_tokens_details"] = {
                f"{k}_prediction_tokens": sum(m[f"{k}_prediction_tokens"] for m in predicted)
                for k in ("accepted", "rejected")}
        if self.reasoning is not None:
            usage.setdefault("completion_tokens_details", {})["reasoning_tokens"] = sum(
                c.tally.count(c.text, lambda k, c=c: [self.tokens.text(t) for t in c.ids[k:]],
                              len(c.ids))
                for c in self.choices if c.tally is not None)
        return usage

    # Streaming ------------------------------------------------------------

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role."""
        if not self.chat:
            return []
        chunks = [self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}) for c in self.choices]
        if self.want_token_ids:  # vLLM's place: the stream's first chunk
            chunks[0]["prompt_token_ids"] = self.prompts[0].token_ids
        return chunks

    def apply(self, delta: dict[str, Any], emit: bool = True) -> list[dict[str, Any]]:
        """Record one engine delta; returns the stream chunks it makes
        (none unless `emit`)."""
        prompt = delta.get("prompt", 0)
        c = self.choices[prompt * self.n + delta["index"]]
        plps = delta.get("prompt_logprobs")
        if self.want_prompt_logprobs and plps is not None and self.prompt_logprobs[prompt] is None:
            self.prompt_logprobs[prompt] = prompt_logprobs(self._wire_prompt(prompt, plps),
                                                           self.tokens)
        text: str = delta["text"]
        entries = self._entries(delta["token_ids"], delta.get("logprobs"))
        if not c.started:
            c.started = True
            if self.echo:
                echo_entries = self._prompt_entries(prompt, delta.get("prompt_logprobs"))
                text = self.prompts[prompt].text + text
                entries = echo_entries + entries
        c.text.append(text)
        c.num_tokens += len(delta["token_ids"])
        if self.keep_ids:
            c.ids += delta["token_ids"]
        if delta["token_ids"]:
            c.last_token = delta["token_ids"][-1]
        c.logprobs += entries
        chunks: list[dict[str, Any]] = []
        finish = delta.get("finish_reason")
        if finish is not None:
            c.stop_reason = delta.get("stop_reason")
        if not emit:
            if finish is not None:
                c.finish_reason = finish
                c.metrics = delta.get("metrics")
            return chunks
        thought = ""
        if c.reasoner is not None:
            thought, text = c.reasoner.feed(text)
            if finish is not None:
                more, rest = c.reasoner.finish()
                thought, text = thought + more, text + rest
        if c.parser is not None:
            return self._tool_chunks(c, text, entries, finish, delta.get("metrics"), thought)
        if text or entries or thought or (finish is None and c.reasoner is None):
            chunks.append(self._chunk(self._stream_choice(
                c, text if c.reasoner is None else text or None, entries, None,
                thought=thought)))
        if finish is not None:
            c.finish_reason = finish
            c.metrics = delta.get("metrics")
            last = self._stream_choice(c, None if self.chat else "", [], finish)
            chunks.append(self._chunk(last, metrics=c.metrics))
        return chunks

    def _tool_chunks(self, c: _Choice, text: str, entries: list[Entry], finish: str | None,
                     metrics: dict[str, Any] | None, thought: str = ""
                     ) -> list[dict[str, Any]]:
        """A chat answer's chunks with tools offered: content and tool-call
        deltas as the parser releases them; the finish reason is
        `tool_calls` where calls ended the answer."""
        assert c.parser is not None
        content, calls = c.parser.feed(text)
        if finish is not None:
            rest, more, finish = c.parser.finish(finish)
            content, calls = content + rest, calls + more
        chunks: list[dict[str, Any]] = []
        if content or calls or entries or thought or self._unsent_ids(c):
            chunks.append(self._chunk(self._stream_choice(c, content or None, entries, None,
                                                          calls, thought)))
        if finish is not None:
            c.finish_reason, c.metrics, c.parsed = finish, metrics, True
            chunks.append(self._chunk(self._stream_choice(c, None, [], finish), metrics=metrics))
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.request_id, "object": self.object, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage()}

    def _stream_choice(self, c: _Choice, text: str | None, entries: list[Entry],
                       finish: str | None, calls: list[dict[str, Any]] | None = None,
                       thought: str = "") -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs and entries:
            logprobs = self._logprobs(c, entries)
        # vLLM's `stop_reason` beside the finish reason that it explains.
        extra: dict[str, Any] = {} if finish is None else {"stop_reason": c.stop_reason}
        if self.want_token_ids:
            # The ids since the last chunk; a completion's first chunk also
            # has its prompt's (vLLM's place).
            if not self.chat and not c.prompt_ids_sent:
                extra["prompt_token_ids"] = self.prompts[c.prompt].token_ids
                c.prompt_ids_sent = True
            extra["token_ids"] = c.ids[c.ids_sent:]
            c.ids_sent = len(c.ids)
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if thought:  # vLLM's names: `reasoning`, and the older `reasoning_content`
                delta["reasoning"] = delta["reasoning_content"] = thought
            if calls:
                delta["tool_calls"] = calls
            return {"index": c.index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish, **extra}
        return {"index": c.index, "text": text or "", "logprobs": logprobs,
                "finish_reason": finish, **extra}

    def _unsent_ids(self, c: _Choice) -> bool:
        return self.want_token_ids and c.ids_sent < len(c.ids)

    def _chunk(self, choice: dict[str, Any], metrics: dict[str, Any] | None = None
               ) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.request_id, "object": self.object,
                                "created": self.created, "model": self.model,
                                "choices": [choice]}
        if metrics is not None:
            body["metrics"] = metrics
        if self.continuous_usage:
            body["usage"] = self.usage()
        return body

    # Whole response -------------------------------------------------------

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            logprobs = None
            if self.want_logprobs:
                c.text_offset = 0
                logprobs = self._logprobs(c, c.logprobs)
            text = "".join(c.text)
            if self.chat:
                reasoning = None
                if self.reasoning is not None:
                    reasoning, text = split_reasoning(text, self.reasoning)
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if reasoning is not None:
                    message["reasoning"] = message["reasoning_content"] = reasoning
                finish = c.finish_reason
                if c.parser is not None:
                    if not c.parsed:
                        c.parser.feed(text)
                        finish = c.finish_reason = c.parser.finish(finish)[2]
                        c.parsed = True
                    message.update(c.parser.message())
                choices.append({"index": c.index, "message": message,
                                "logprobs": logprobs, "finish_reason": finish,
                                "stop_reason": c.stop_reason})
            else:
                choices.append({"index": c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
                if self.want_prompt_logprobs:
                    choices[-1]["prompt_logprobs"] = self.prompt_logprobs[c.prompt]
                if self.want_token_ids:
                    choices[-1]["prompt_token_ids"] = self.prompts[c.prompt].token_ids
            if self.want_token_ids:
                choices[-1]["token_ids"] = c.ids
        out = {"id": self.request_id, "object": "chat.completion" if self.chat
               else "text_completion", "created": self.created, "model": self.model,
               "choices": choices, "usage": self.usage()}
        if self.want_prompt_logprobs and self.chat:
            out["prompt_logprobs"] = self.prompt_logprobs[0]  # vLLM's place for chat
        if self.want_token_ids and self.chat:
            out["prompt_token_ids"] = self.prompts[0].token_ids
        return {**out, "metrics": self.choices[0].metrics}

    # Logprobs -------------------------------------------------------------

    def _logprobs(self, c: _Choice, entries: list[Entry]) -> dict[str, Any]:
        if self.chat:
            return chat_logprobs(entries, self.tokens, self.logprob_ids)
        out, c.text_offset = completion_logprobs(entries, self.tokens, c.text_offset,
                                                 self.logprob_ids)
        return out

    def _entries(self, token_ids: list[int], logprobs: list[dict[str, Any]] | None
                 ) -> list[Entry]:
        if not self.want_logprobs or logprobs is None:
            return []
        return [(t, WireLogprob.model_validate(lp)) for t, lp in zip(token_ids, logprobs)]

    def _prompt_entries(self, prompt: int, plps: list[dict[str, Any] | None] | None
                        ) -> list[Entry]:
        if not self.want_logprobs:
            return []
        if plps is None:
            raise RuntimeError("echo with logprobs needs the prompt's logprobs")
        return self._wire_prompt(prompt, plps)

    def _wire_prompt(self, prompt: int, plps: list[dict[str, Any] | None]) -> list[Entry]:
        """A prompt's tokens with the engine's logprobs of each (None first)."""
        return [(t, None if lp is None else WireLogprob.model_validate(lp))
                for t, lp in zip(self.prompts[prompt].token_ids, plps)]
