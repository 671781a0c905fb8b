"""The chat-template frame around a truncated prompt (`ModelConfig.prompt_format`).

A chat model answers a prompt that sits inside its template, and the hidden
state at the start of the assistant turn is where it begins to answer: that
is the state a length probe wants.  The frame is the template rendered around
a placeholder, split into the token ids before and after the user's text, so
the truncated prompt ids (first head + last tail tokens) are framed without
re-tokenizing them; the ids therefore match training and serving exactly.
"""

from __future__ import annotations

from typing import Any

from engine.tokenizer import chat_template, render_chat

_PLACEHOLDER = "\x00PROMPT\x00"


def chat_frame(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids before and after the user message in the chat template."""
    if not chat_template(tokenizer):
        raise ValueError("prompt_format 'chat' needs a tokenizer with a chat template")
    # Rendered as the ingress renders a served chat request, so the frame is
    # what serving puts around a lone user message.
    text = render_chat(tokenizer, [{"role": "user", "content": _PLACEHOLDER}])
    if text.count(_PLACEHOLDER) != 1:
        raise ValueError("the chat template does not place the user message verbatim")
    before, after = text.split(_PLACEHOLDER)
    enc = tokenizer([before, after], add_special_tokens=False)["input_ids"]
    return list(enc[0]), list(enc[1])
