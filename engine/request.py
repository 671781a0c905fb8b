"""Per-request engine state: sampling parameters, outputs, detokenizer.

It lives from `add_request` to `remove_request` and deliberately survives
preemption: a preempted job's KV is dropped and recomputed, but its sampled
tokens, its detokenizer (what text was already streamed) and its seed
stream position are kept, so the client never sees text twice and seeded
sampling continues where it left off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams


@dataclass(eq=False)
class RequestState:
    job_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    # Token ids that end the request: stop_token_ids, plus EOS unless
    # ignore_eos.
    stop_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def banned_token_ids(self) -> tuple[int, ...]:
        """Stop tokens may not be sampled before min_tokens outputs exist."""
        if len(self.output_token_ids) < self.params.min_tokens:
            return tuple(sorted(self.stop_token_ids))
        return ()

    def append(self, token_id: int, max_model_len: int) -> tuple[str, str | None]:
        """Record a sampled token; returns (text delta, finish reason or None)."""
        if self.finish_reason is not None:
            raise RuntimeError(f"request {self.job_id} already finished ({self.finish_reason})")
        self.output_token_ids.append(token_id)
        n = len(self.output_token_ids)
        past_min = n >= self.params.min_tokens
        if past_min and token_id in self.stop_token_ids:
            # The stop token's own text is not part of the response.
            self.finish_reason = "stop"
            return self.detokenizer.flush(), self.finish_reason
        text = self.detokenizer.add_token(token_id, check_stop=past_min)
        if self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif (
            self.params.max_tokens is not None and n >= self.params.max_tokens
        ) or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
            text += self.detokenizer.flush()
        return text, self.finish_reason
