"""Tokenizer, EOS ids and chat template of a local model folder.

Light on purpose (no model weights, no torch tensors): the ingress uses it
to apply the chat template and count prompt tokens, the runner to
detokenize, the length predictor to frame its prompts.  The chat template
is applied here and nowhere else (`render_chat`), so a chat prompt is the
same token ids wherever it is built.  `local_files_only` everywhere: no hub
access.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


def _as_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def eos_token_ids(
    model_path: str | Path, tokenizer: PreTrainedTokenizerBase, config: Any
) -> set[int]:
    """Every id that ends a generation: tokenizer, model config and
    generation config may each name some (chat models often add their
    end-of-turn token in generation_config.json only)."""
    ids = _as_ids(tokenizer.eos_token_id) | _as_ids(getattr(config, "eos_token_id", None))
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        ids |= _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
    return ids


def chat_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    return getattr(tokenizer, "chat_template", None)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The prompt text of a chat conversation in the model's template; with
    `add_generation_prompt` it ends where the assistant's answer begins."""
    if not chat_template(tokenizer):
        raise ValueError("the model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )
    return str(text)


def encode_chat_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of text `render_chat` produced.  No special tokens are
    added: the template already wrote those the model expects (a second BOS
    would change the prompt)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Prompt token ids of a chat conversation, via the model's template."""
    text = render_chat(tokenizer, messages, add_generation_prompt, **template_kwargs)
    return encode_chat_text(tokenizer, text)
