"""Per-request engine state: sampling parameters, outputs, detokenizer.

It lives from `add_request` to `remove_request` and deliberately survives
preemption: a preempted job's KV is dropped and recomputed, but its sampled
tokens, its detokenizer (what text was already streamed) and its seed
stream position are kept, so the client never sees text twice and seeded
sampling continues where it left off; so is the grammar's matcher of a
structured request.  So are the prompt logprobs computed
so far: a recomputed prompt does not compute or deliver them again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from engine.bad_words import banned_by_words, needs_history
from engine.detokenizer import IncrementalDetokenizer
from engine.lora import Adapter
from engine.sampling_params import SamplingParams
from engine.structured import RequestGrammar
from scheduler.plan import TokenLogprob


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
    # vLLM's `stop_reason`: the stop string or the stop token id (of
    # `stop_token_ids`, not EOS) that ended it.
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # While prompt logprobs are owed: entry p for prompt token p (entry 0,
    # which has no context, is None), as far as computed.  None when not
    # asked for or already delivered.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Its grammar's matcher (`engine.structured.RequestGrammar`) when it
    # asked for structured output; kept, like its outputs, across
    # preemption.
    grammar: RequestGrammar | None = None
    # The LoRA adapter it runs with (engine/lora_pool.py), held until it
    # ends whatever the pool drops meanwhile.
    lora: Adapter | None = None

    # Whether sampling its next token reads its previous one whatever the
    # step (penalties, a grammar, bad words of several tokens): fixed for
    # its life, read for every chunk a plan launched ahead holds.
    samples_on_history: bool = field(init=False)
    # Whether, once past min_tokens, its token is the plain argmax of the
    # logits (greedy; no grammar, bias, bans or penalties): fixed for its
    # life, so a batch of such rows skips building their `SampleRequest`s.
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        # A request resumed with outputs (migration) delivered them where
        # its first token was sampled.
        if self.params.prompt_logprobs is not None and not self.output_token_ids:
            self.prompt_logprobs = [None]
        self.samples_on_history = (self.params.has_penalties or self.grammar is not None
                                   or needs_history(self.params.bad_words_token_ids))
        p = self.params
        self.plain_greedy = (p.greedy and self.grammar is None and not p.reweights
                             and not p.bad_words_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def banned_token_ids(self, drafts: Sequence[int] = ()) -> tuple[int, ...]:
        """What may not be sampled next: stop tokens before min_tokens
        outputs exist, and the last token of a bad word the answer would end
        with (`drafts`: speculative drafts before the token, taken as
        outputs)."""
        banned: tuple[int, ...] = ()
        if len(self.output_token_ids) + len(drafts) < self.params.min_tokens:
            banned = tuple(sorted(self.stop_token_ids))
        if words := self.params.bad_words_token_ids:
            history = [*self.output_token_ids, *drafts] if drafts else self.output_token_ids
            banned += tuple(banned_by_words(words, history))
        return banned

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Positions q in `[start, end)` whose next-token logits give a
        prompt logprob not yet computed (that of prompt token q + 1)."""
        owed = self.prompt_logprobs
        num_prompt = len(self.prompt_token_ids)
        if owed is None or len(owed) == num_prompt:
            return range(0)
        next_pos = len(owed) - 1
        if start > next_pos:
            # Positions before `start` were computed elsewhere (a prompt
            # whose KV is shared from a sibling choice): their logits never
            # existed here, and a partial list would silently mislead.
            raise ValueError(
                f"job {self.job_id}: prompt_logprobs need the logits at prompt position "
                f"{next_pos}, but its KV starts at position {start} (computed by another "
                "request); ask prompt_logprobs on the request that prefills the prompt"
            )
        return range(next_pos, min(end, num_prompt - 1))

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The complete prompt logprobs, once (on the first sampled token)."""
        owed = self.prompt_logprobs
        if owed is None:
            return None
        if len(owed) != len(self.prompt_token_ids):
            raise RuntimeError(
                f"job {self.job_id}: sampling with {len(owed)} of "
                f"{len(self.prompt_token_ids)} prompt logprobs computed"
            )
        self.prompt_logprobs = None
        return owed

    def append(self, token_id: int, max_model_len: int) -> tuple[str, str | None]:
        """Record a sampled token; returns (text delta, finish reason or None)."""
        past_min = self._record(token_id)
        if past_min and token_id in self.stop_token_ids:
            # The stop token's own text is not part of the response.
            self._stopped_by(token_id)
            return self.detokenizer.flush(), self.finish_reason
        text = self.detokenizer.add_token(token_id, check_stop=past_min)
        if self.detokenizer.stopped:
            self.finish_reason, self.stop_reason = "stop", self.detokenizer.stop_reason
        elif self._at_length(max_model_len):
            self.finish_reason = "length"
            text += self.detokenizer.flush()
        return text, self.finish_reason

    @property
    def text_can_wait(self) -> bool:
        """No stop string can end the request, so whether it finishes never
        depends on its text: `append_later` may leave the decoding for
        later."""
        return not self.detokenizer.stop

    def append_later(self, token_id: int,
                     max_model_len: int) -> tuple[Callable[[], str], str | None]:
        """`append` for a request whose text can wait: the finish reason
        now, from the token alone, and a call that decodes the text delta.
        The calls must run in the order the tokens were appended, one at a
        time (they advance the request's detokenizer)."""
        if not self.text_can_wait:
            raise RuntimeError(f"request {self.job_id} has stop strings: its text cannot wait")
        past_min = self._record(token_id)
        if past_min and token_id in self.stop_token_ids:
            self._stopped_by(token_id)
            return self.detokenizer.flush, self.finish_reason
        if self._at_length(max_model_len):
            self.finish_reason = "length"
        return partial(self._decode, token_id, self.finish_reason is not None), self.finish_reason

    def _stopped_by(self, token_id: int) -> None:
        self.finish_reason = "stop"
        if token_id in self.params.stop_token_ids:
            self.stop_reason = token_id

    def _record(self, token_id: int) -> bool:
        """Append the token; returns whether min_tokens is reached."""
        if self.finish_reason is not None:
            raise RuntimeError(f"request {self.job_id} already finished ({self.finish_reason})")
        self.output_token_ids.append(token_id)
        return len(self.output_token_ids) >= self.params.min_tokens

    def _at_length(self, max_model_len: int) -> bool:
        max_tokens = self.params.max_tokens
        return ((max_tokens is not None and len(self.output_token_ids) >= max_tokens)
                or self.num_tokens >= max_model_len)

    def _decode(self, token_id: int, last: bool) -> str:
        text = self.detokenizer.add_token(token_id, check_stop=False)
        return text + self.detokenizer.flush() if last else text
