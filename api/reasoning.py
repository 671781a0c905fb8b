"""A reasoning model's answer split into its reasoning and its content, as
it streams (`reasoning_parser`, vLLM's parsers of the same names).

- `deepseek_r1`: the reasoning runs from the start of the answer to the
  first `</think>`; an opening `<think>` there is dropped (DeepSeek-R1's
  template opens it in the prompt, so its answers mostly begin inside it).
  An answer that never closes it (cut by `max_tokens`) is reasoning whole.
- `qwen3`: an answer that begins with `<think>` reasons until `</think>`;
  one that does not (thinking switched off) is content whole.

The content starts at the first non-blank text after `</think>` (the
blank line models write there is not content).  Text that may be the
start of a tag is held back until the next piece shows whether it is one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from api.tool_parser import partial_tail

ReasoningFormat = Literal["deepseek_r1", "qwen3"]
OPEN, CLOSE = "<think>", "</think>"


def reasoning_format(setting: str) -> ReasoningFormat | None:
    """`reasoning_parser` as a format (None: "none")."""
    return None if setting == "none" else setting  # type: ignore[return-value]


def check_reasoning(req: Any, use: Any, setting: str) -> None:
    """A 400 naming the field for a chat request whose grammar would bind
    a reasoning model's reasoning too: the grammar starts with the answer,
    and the reasoning comes first.  Tools offered with `auto` are served
    (their grammar waits for a call's opening tag)."""
    from api.errors import APIError

    if setting == "none":
        return
    why = "cannot be served with reasoning_parser: its grammar would bind the reasoning too"
    for name in ("response_format", "structured_outputs"):
        fmt = getattr(req, name, None)
        if fmt is not None and getattr(fmt, "type", None) != "text":
            raise APIError(400, f"{name} {why}", name)
    if use is not None and use.mode in ("required", "named"):
        raise APIError(400, f"tool_choice {use.mode} {why}", "tool_choice")


class ReasoningParser:
    """One answer's parser."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        # "start" (nothing decided), "reasoning", "after" (closed; blanks
        # dropped until text), "content".
        self.state = "start"
        self.reasoned = False  # the answer had a reasoning part
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that `text`, the answer's next
        piece, adds."""
        self._buf += text
        reasoning: list[str] = []
        while True:
            if self.state == "start":
                lead = self._buf.lstrip()
                if len(lead) < len(OPEN) and OPEN.startswith(lead):
                    break  # blank, or maybe the opening tag: wait
                if lead.startswith(OPEN):
                    self._buf = lead[len(OPEN):]
                    self.state = "reasoning"
                else:
                    self.state = "reasoning" if self.fmt == "deepseek_r1" else "content"
                self.reasoned = self.state == "reasoning"
            elif self.state == "reasoning":
                k = self._buf.find(CLOSE)
                if k < 0:
                    cut = len(self._buf) - partial_tail(self._buf, CLOSE)
                    reasoning.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                reasoning.append(self._buf[:k])
                self._buf, self.state = self._buf[k + len(CLOSE):], "after"
            elif self.state == "after":
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self.state = "content"
            else:
                content, self._buf = self._buf, ""
                return "".join(reasoning), content
        return "".join(reasoning), ""

    @property
    def reasons_so_far(self) -> bool:
        """Whether the answer so far has a reasoning part, as `finish` would
        decide were it to end here."""
        return self.reasoned or (self.state == "start" and self.fmt == "deepseek_r1"
                                 and bool(self._buf.strip()))

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the answer."""
        rest, self._buf = self._buf, ""
        if self.state == "start":
            self.reasoned = self.fmt == "deepseek_r1" and bool(rest.strip())
            return (rest, "") if self.reasoned else ("", rest)
        if self.state == "reasoning":
            return rest, ""
        return "", "" if self.state == "after" else rest


def split_reasoning(text: str, fmt: ReasoningFormat) -> tuple[str | None, str]:
    """A whole answer's reasoning (None: it had none) and content."""
    p = ReasoningParser(fmt)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2 if p.reasoned else None), c1 + c2


class ReasoningTally:
    """What `split_reasoning` says of an answer that grows, and how many of
    its tokens its reasoning took (up to the one that completes `</think>`,
    or all of them), for the usage on every chunk of a stream: each piece
    and each token's text is read once, however often it is asked for."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._parser = ReasoningParser(fmt)
        self._pieces = 0
        self._tokens = 0
        self._count = 0
        self._seen = ""
        self._closed = False

    def count(self, pieces: list[str], token_texts: Callable[[int], list[str]],
              num_tokens: int) -> int:
        """The reasoning tokens of the answer whose text is `pieces` and
        whose `num_tokens` tokens' texts `token_texts(k)` gives from the
        k-th on (0 where it has no reasoning)."""
        for piece in pieces[self._pieces:]:
            self._parser.feed(piece)
        self._pieces = len(pieces)
        if not self._closed and num_tokens > self._tokens:
            for t in token_texts(self._tokens):
                self._count += 1
                self._seen = (self._seen + t)[-(len(CLOSE) + len(t)):]
                if CLOSE in self._seen:
                    self._closed = True
                    break
        self._tokens = num_tokens
        return self._count if self._parser.reasons_so_far else 0
