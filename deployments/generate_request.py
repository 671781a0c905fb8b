"""The engine's request for one prompt of a chat or completion request:
the prompt cut to fit (vLLM's `truncate_prompt_tokens`), the limits the
context sets checked, the sampling fields carried, and the LoRA adapter the
request names resolved (with its folder, for one loaded at runtime)."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from api.errors import APIError
from api.protocol import GenerateRequest
from api.responses import PromptInput
from engine.bad_words import bad_words_token_ids
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_chat_text


def generate_request(ing: Any, req: Any, prompt: PromptInput, request_id: str, chat: bool
                     ) -> GenerateRequest:
    """The engine request for one prompt of chat or completion request `req`
    (all its `n` choices) at Ingress `ing`; a 400 for anything the engine
    could not serve."""
    limit = ing.cfg.max_model_len
    if (keep := req.truncate_prompt_tokens) is not None:
        asked = req.token_limit if chat else req.max_tokens
        prompt.keep_last(keep if keep > 0 else max(1, limit - (asked or 1)),
                         ing.tokenizer.decode)
    ids = prompt.token_ids
    param = "messages" if chat else "prompt"
    if len(ids) >= limit:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this model's maximum "
                       f"context length is {limit} tokens", param)
    asked = req.token_limit if chat else req.max_tokens
    max_tokens = asked if asked is not None else limit - len(ids)
    if len(ids) + max_tokens > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, "
                       f"but {len(ids)} prompt tokens + max_tokens={max_tokens} exceed it",
                       "max_completion_tokens" if chat and req.max_completion_tokens
                       else "max_tokens")
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}",
                       "min_tokens")
    bias = req.bias_by_id()
    if any(t >= ing.vocab_size for t in bias):
        raise APIError(400, f"logit_bias keys must be token ids below {ing.vocab_size}",
                       "logit_bias")
    if any(t >= ing.vocab_size for t in req.allowed_token_ids or ()):
        raise APIError(400, f"allowed_token_ids must be below {ing.vocab_size}",
                       "allowed_token_ids")
    stop_ids = req.stop_token_ids or []
    if any(t >= ing.vocab_size for t in stop_ids):
        raise APIError(400, f"stop_token_ids must be below {ing.vocab_size}",
                       "stop_token_ids")
    logprobs = req.num_logprobs if chat else req.logprobs
    prompt_logprobs = req.prompt_logprobs
    # A LoRA adapter: loaded at start, or at runtime (with its folder).
    runtime = ing.lora.loaded().get(req.model) if req.model else None
    adapter = req.model if runtime or req.model in ing.cfg.lora_adapters else None
    if not chat and req.echo and logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    return GenerateRequest(
        request_id=request_id, prompt_token_ids=ids, max_tokens=max_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed,
        stop=req.stop or [], stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        min_tokens=req.min_tokens, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=bias,
        allowed_token_ids=req.allowed_token_ids,
        bad_words_token_ids=bad_words_token_ids(req.bad_words or (),
                                                partial(encode_chat_text, ing.tokenizer)),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, n=req.n, priority=req.priority,
        job_class=req.job_class, jct_slo_s=req.jct_slo_s, adapter=adapter,
        adapter_path=runtime and runtime.path,
        adapter_loaded_at=runtime and runtime.loaded_at,
        # An adapter's KV is its own (a runtime one's, its load's): cached
        # apart from the base model's.
        cache_salt=req.cache_salt if adapter is None else
        f"lora:{adapter}@{runtime and runtime.loaded_at}\x00{req.cache_salt or ''}",
        prompt_cache_key=req.prompt_cache_key,
        arrival_time=time.time(), streamed=bool(req.stream),
        stream_interval=ing.cfg.stream_interval,
        prediction_token_ids=_predicted(ing, req) if chat else None)


def _predicted(ing: Any, req: Any) -> list[int] | None:
    """A chat request's `prediction` as tokens (OpenAI's Predicted Outputs:
    drafts for speculative decoding)."""
    if req.prediction is None:
        return None
    if not ing.cfg.speculative.num_tokens:
        raise APIError(400, "prediction needs speculative decoding, which this server has "
                       "off (speculative.num_tokens is 0)", "prediction")
    text = req.prediction.text()
    return encode_chat_text(ing.tokenizer, text)[:ing.cfg.max_model_len]


def check_prediction(gen: GenerateRequest) -> None:
    """A 400 naming `prediction` for a request whose drafts the engine could
    not verify (engine/speculative.py); called once its structure is known."""
    if gen.prediction_token_ids is not None and not sampling_params(gen).draftable:
        raise APIError(400, "prediction is not served with logprobs, structured output or "
                       "tools (drafts are checked without them)", "prediction")


# The request fields a choice's SamplingParams take as they are.
_PARAMS = ("temperature", "top_p", "top_k", "min_p", "stop", "include_stop_str_in_output",
           "skip_special_tokens", "stop_token_ids", "max_tokens", "ignore_eos", "min_tokens",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
           "allowed_token_ids", "bad_words_token_ids", "logprobs", "prompt_logprobs",
           "structured", "adapter", "adapter_path", "adapter_loaded_at")


def sampling_params(req: GenerateRequest, index: int = 0) -> SamplingParams:
    """Choice `index`'s parameters, seeded `seed + index`: vLLM's rule."""
    return SamplingParams(seed=None if req.seed is None else req.seed + index,
                          **{f: getattr(req, f) for f in _PARAMS})
