"""The part of `ModelRunner` that turns a `Plan` into one pass's inputs:
the chunks flattened into one batch (decodes first), the rows whose logits
are sampled or owed as prompt logprobs, and what launching a plan while
another is in flight needs (scheduler/ahead.py): whether it may be, the
rows whose last token the device fills from that pass's sampled ids
(`PENDING_TOKEN`), and those ids on the host once they land."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine.attention import SeqSpan
from engine.device_lists import on_device
from engine.lora import Adapter, LoraStep
from engine.models import ForwardBatch
from engine.prepared import PreparedStep
from engine.request import RequestState
from engine.sampling import SampleRequest
from engine.structured import GrammarCompiler, open_rows
from engine.step_logprobs import PromptRows
from scheduler.plan import PENDING_TOKEN, Plan, ScheduledChunk, StepResult


def plain_greedy(sampled: list[tuple[ScheduledChunk, RequestState]]) -> bool:
    """Whether every sampled row takes the plain argmax of its logits: no
    drafts, and each request plain greedy (`RequestState.plain_greedy`) and
    past its min_tokens (before, its stop tokens are banned)."""
    for chunk, state in sampled:
        if (chunk.draft or not state.plain_greedy
                or len(state.output_token_ids) < state.params.min_tokens):
            return False
    return True


@dataclass(slots=True)
class Pending:
    """A launched plan (`ModelRunner.launch`) until `collect`."""

    plan: Plan
    prepared: PreparedStep | None
    started: float
    # The sampled ids: on the device, their host copy and its event (CUDA).
    tokens: torch.Tensor | None = None
    host_tokens: torch.Tensor | None = None
    ready: Any = None
    logits: torch.Tensor | None = None
    # Job id -> its row among the sampled ids.
    rows: dict[str, int] | None = None
    # Already complete at launch: no chunks, or the pass was cut.
    result: StepResult | None = None
    # Collecting reads the logits (logprobs), which the next pass may
    # overwrite (graph buckets keep theirs in place).
    reads_logits: bool = False
    # The length head's estimates for jobs that sampled their first token:
    # their ids and the lengths (on CUDA, a pinned host copy once launched).
    lengths: tuple[list[str], torch.Tensor] | None = None
    # What breaks ties of rounded logits (`CausalLM.exact_source`).
    exact: tuple[torch.Tensor, torch.Tensor] | None = None

    def head_lengths(self) -> dict[str, int]:
        """Job id -> the length head's estimate (read once the pass landed)."""
        if self.lengths is None:
            return {}
        return dict(zip(self.lengths[0], self.lengths[1].tolist()))

    def copy_to_host(self, tokens: torch.Tensor) -> None:
        """Queue copies of the sampled ids `tokens` (and of the head's
        estimates) into pinned host memory behind the pass, and the event
        that says they landed: reading them then waits for nothing else.  A
        read of a device tensor (`tolist`) would wait for every pass queued
        since, the one launched ahead of this collect included."""
        self.host_tokens = _pinned_copy(tokens)
        if self.lengths is not None:
            self.lengths = self.lengths[0], _pinned_copy(self.lengths[1])
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(tokens.device))


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class PlanPreparing:
    """Mixed into `ModelRunner`, which sets these attributes."""

    device: torch.device
    max_model_len: int
    attn: Any
    world: int
    _requests: dict[str, RequestState]
    _in_flight: Pending | None
    grammars: GrammarCompiler
    lora_linear: Any

    if TYPE_CHECKING:
        def _launched(self) -> float: ...

    def can_run_ahead(self, pending: Pending, plan: Plan) -> bool:
        """Whether `plan` may be launched before `pending` is collected:
        neither collecting `pending` reads logits the next pass may
        overwrite, nor does a request of `plan` sample with what `pending`
        samples for it (penalties over its outputs, min_tokens and bad
        words' bans)."""
        if self.world > 1 or pending.result is not None or pending.reads_logits:
            return False
        rows = pending.rows or {}
        requests = self._requests
        for chunk in plan.chunks:
            if chunk.job_id in rows:
                state = requests.get(chunk.job_id)
                if state is not None and (
                        state.samples_on_history
                        or state.params.min_tokens > len(state.output_token_ids)):
                    return False
        return True

    def _sample_requests(
        self, sampled: list[tuple[ScheduledChunk, RequestState]]
    ) -> list[SampleRequest]:
        """What sampling needs of each sampled row: its parameters, its seed
        stream position, its bans and histories, and for a structured
        request the tokens its grammar allows next (the grammar having
        accepted every output: a plan that samples for it is never run
        ahead of the pass that samples its previous token)."""
        grammars = [(i, s.grammar) for i, (_, s) in enumerate(sampled) if s.grammar is not None]
        allowed: dict[int, torch.Tensor] = {}
        if grammars:
            bitmask = self.grammars.bitmask(len(grammars))  # every token allowed
            for k, (i, grammar) in enumerate(grammars):
                grammar.advance(sampled[i][1].output_token_ids)
                grammar.fill(bitmask, k)  # left as it is once the grammar has ended
            # A row its grammar leaves open samples as a free one.
            open_ = open_rows(bitmask, self.grammars.vocab_size)
            allowed = {i: bitmask[k] for k, (i, _) in enumerate(grammars) if not open_[k]}
        # Most rows ban nothing: past min_tokens, no bad words.
        return [SampleRequest(s.params, c.output_index,
                              () if len(s.output_token_ids) >= s.params.min_tokens
                              and not s.params.bad_words_token_ids else s.banned_token_ids(),
                              s.prompt_token_ids, s.output_token_ids, allowed.get(i))
                if not c.draft else _after_drafts(c, s, c.draft)
                for i, (c, s) in enumerate(sampled)] + [
            _after_drafts(c, s, j) for c, s in sampled for j in range(c.draft)]

    def _host_tokens(self, pending: Pending) -> tuple[list[int], float]:
        """The sampled ids on the host, and the seconds `on_launch` took: on
        a GPU the host runs `on_launch` before it waits for the copy."""
        if pending.tokens is None:
            return [], 0.0
        if pending.ready is None:
            return pending.tokens.tolist(), 0.0
        spent = self._launched()
        pending.ready.synchronize()
        assert pending.host_tokens is not None
        return pending.host_tokens.tolist(), spent

    def _prepare(self, plan: Plan) -> PreparedStep:
        """Flatten the plan's chunks (decodes first: the attention backend
        batches them in one call) into one forward batch.

        The logits rows are the sampling chunks' last tokens, in `sampled`
        order, then the rows whose picks a chunk's drafts must match, then
        the prompt positions whose logprobs are owed.  Nothing is recorded
        in any request's state: that happens after the forward pass
        succeeded."""
        ordered = sorted(plan.chunks, key=lambda c: len(c.token_ids) != 1)
        sampled: list[tuple[ScheduledChunk, RequestState]] = []
        prompt_rows: list[PromptRows] = []
        input_ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        logits_indices: list[int] = []
        prompt_indices: list[int] = []
        fill_rows: list[int] = []
        fill_from: list[int] = []
        lora_rows: dict[int, tuple[Adapter, list[int]]] = {}
        verify: dict[int, int] = {}
        verify_rows: list[int] = []
        requests, max_len = self._requests, self.max_model_len
        # Once per chunk per step (every running sequence's decode): the
        # checks' common cases inlined, their methods called where they apply.
        for chunk in ordered:
            state = requests.get(chunk.job_id) or self._state(chunk)
            start, ids = chunk.start_pos, chunk.token_ids
            end = start + len(ids)
            if end > max_len:
                raise ValueError(
                    f"job {chunk.job_id}: position {end} exceeds max_model_len {max_len}"
                )
            num_prompt = len(state.prompt_token_ids)
            if state.prompt_logprobs is not None:
                owed = state.prompt_logprob_positions(start, end)
                if owed:
                    base = len(input_ids) - start
                    prompt_indices.extend(range(base + owed.start, base + owed.stop))
                    prompt_rows.append(PromptRows(state, owed))
            in_flight = 0
            if ids and min(ids) < 0:
                ids, in_flight = self._pending_token(chunk, state, len(input_ids),
                                                     fill_rows, fill_from)
            if state.lora is not None:
                lora_rows.setdefault(id(state.lora), (state.lora, []))[1].extend(
                    range(len(input_ids), len(input_ids) + len(ids)))
            input_ids.extend(ids)
            positions.extend(range(start, end))
            spans.append(SeqSpan(start, len(ids), chunk.block_table, num_prompt))
            if chunk.sample:
                outputs = len(state.output_token_ids) + in_flight
                if (chunk.output_index != outputs
                        or end - chunk.draft != num_prompt + outputs):
                    self._check_sample_point(chunk, state, in_flight)
                logits_indices.append(len(input_ids) - 1)
                if chunk.draft:  # the rows whose picks the drafts must match
                    verify[len(sampled)] = len(verify_rows)
                    verify_rows.extend(range(len(input_ids) - 1 - chunk.draft,
                                             len(input_ids) - 1))
                sampled.append((chunk, state))
        return PreparedStep(input_ids, positions, spans,
                            logits_indices + verify_rows + prompt_indices, sampled,
                            prompt_rows, fill_rows, fill_from, lora_rows, verify,
                            len(verify_rows))

    def _pending_token(self, chunk: ScheduledChunk, state: RequestState, offset: int,
                       fill_rows: list[int], fill_from: list[int]) -> tuple[list[int], int]:
        """`chunk`'s ids with its last one, `PENDING_TOKEN`, resolved: from
        the pass in flight on the device (a fill row; 1 output still to
        land), or from the request's outputs where that pass was collected
        since the plan was made (0)."""
        ids = chunk.token_ids
        # A decode's one id needs no scan (every step's case).
        if ids[-1] != PENDING_TOKEN or (len(ids) > 1 and min(ids[:-1]) < 0):
            raise ValueError(f"job {chunk.job_id}: token ids {ids[:8]}... hold an id < 0 "
                             "other than the last token's")
        last = chunk.start_pos + len(ids) - 1
        prev = self._in_flight
        row = None if prev is None or prev.rows is None else prev.rows.get(chunk.job_id)
        if row is not None:
            fill_rows.append(offset + len(ids) - 1)
            fill_from.append(row)
            return ids[:-1] + [0], 1
        index = last - len(state.prompt_token_ids)
        if not 0 <= index < len(state.output_token_ids):
            raise ValueError(f"job {chunk.job_id}: the token at position {last} is "
                             "neither sampled nor in flight")
        return ids[:-1] + [state.output_token_ids[index]], 0

    def _fill(self, prepared: PreparedStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's ids, their sampled ids) for the tokens the
        pass in flight samples, read on the device; None if there are none."""
        if not prepared.fill_rows:
            return None
        prev = self._in_flight
        assert prev is not None and prev.tokens is not None
        rows = on_device(prepared.fill_rows + prepared.fill_from, torch.long, self.device)
        n = len(prepared.fill_rows)
        return rows[:n], prev.tokens.index_select(0, rows[n:]).to(torch.long)

    def _forward_batch(self, prepared: PreparedStep) -> ForwardBatch:
        dev = self.device
        ids = on_device(prepared.input_ids, torch.long, dev)
        fill = self._fill(prepared)
        if fill is not None:
            ids.index_copy_(0, *fill)
        return ForwardBatch(
            input_ids=ids,
            positions=on_device(prepared.positions, torch.long, dev),
            attn_metadata=self.attn.build_metadata(prepared.spans),
            logits_indices=on_device(prepared.logits_indices, torch.long, dev),
            lora=self._lora_step(prepared.lora_rows, len(prepared.input_ids)),
        )

    def _lora_step(self, lora_rows: dict[int, tuple[Adapter, list[int]]], num_rows: int
                   ) -> LoraStep | None:
        """The pass's adapters and their rows (engine/lora.py), by adapter
        object (two versions of one name may share a pass); None where every
        row runs the base model."""
        if not lora_rows:
            return None
        return LoraStep([(adapter, None if len(rows) == num_rows else
                          on_device(rows, torch.long, self.device))
                         for adapter, rows in lora_rows.values()], self.lora_linear,
                        fused=self.lora_linear is F.linear)

    def _state(self, chunk: ScheduledChunk) -> RequestState:
        try:
            return self._requests[chunk.job_id]
        except KeyError:
            raise KeyError(
                f"job {chunk.job_id!r} was scheduled but never added (add_request)"
            ) from None

    @staticmethod
    def _check_sample_point(chunk: ScheduledChunk, state: RequestState,
                            in_flight: int = 0) -> None:
        # The seeded stream and the stop conditions count outputs; a drift
        # between scheduler and engine would silently break reproducibility.
        # `in_flight`: outputs sampled by the pass in flight, not yet here.
        if (
            chunk.output_index != len(state.output_token_ids) + in_flight
            or chunk.start_pos + chunk.num_known_tokens != state.num_tokens + in_flight
        ):
            raise RuntimeError(
                f"job {chunk.job_id}: scheduler samples output {chunk.output_index} after "
                f"{chunk.start_pos + chunk.num_tokens} tokens, engine has "
                f"{len(state.output_token_ids)} outputs and {state.num_tokens} tokens"
            )


def _after_drafts(chunk: ScheduledChunk, state: RequestState, j: int) -> SampleRequest:
    """The row after `chunk`'s first `j` drafts (engine/speculative.py): it
    samples output `output_index + j` as if those drafts were outputs, its
    seed stream, bans and penalties' history counting them, so that what it
    picks is what a step without drafts would pick once they were accepted."""
    drafts = chunk.token_ids[len(chunk.token_ids) - chunk.draft:][:j]
    return SampleRequest(state.params, chunk.output_index + j, state.banned_token_ids(drafts),
                         state.prompt_token_ids, [*state.output_token_ids, *drafts])
