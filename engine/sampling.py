"""Batched next-token sampling: logit bias, penalties, greedy, temperature,
top-k, top-p, seeds; and the logprobs of chosen tokens.

The logits of a row pass through, in vLLM's order: its grammar's mask
(structured output, `engine/structured.py`), `allowed_token_ids`,
logit_bias, the min_tokens and bad words' bans, the repetition penalty (over prompt and output), the
presence / frequency penalties (over the output), then temperature, min_p,
top-k and top-p.  Greedy rows take the argmax after bias and penalties.  Each
stage touches only the rows that use it, and a batch where no row does
skips them all.

Sampling inverts each row's cumulative distribution: one uniform variate
per row, located by binary search in the float64 running sum of `probs`.
That draws exactly from `probs` (up to float64 rounding) with one random
number per row; the exponential race (`argmax(probs / noise)`, one
exponential variate per vocabulary entry) cost 46 ms a step at batch 32 and
a 49k vocabulary on a CPU core, against 6.5 ms for this.  A seeded row's
variate comes from its own generator, seeded from `(seed, output_index)`:
the k-th output token of a seeded request depends only on its logits, its
seed and k, not on which other requests share the batch, nor on whether the
request was preempted and recomputed in between (preemption transparency).
Unseeded rows share one global generator.  On CPU the random rows that no
grammar, bias, ban or penalty changes are drawn by a C++ operator
(`engine/csrc/sample_rows.cpp`: temperature, min_p, top-k, top-p and the
draw, reading the logits where they are), the same rules and variates as
the torch stages here; the other rows, and every row on a GPU, take these.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat

import torch

from engine import attention_cpp, top_k_top_p
from engine.device_lists import index, on_device, staged
from engine.logits_cpu import ExactSource, argmax_rows
from engine.sampling_params import SamplingParams
from engine.structured import mask_logits
from engine.top_k_top_p import apply_top_k_top_p, top_k_top_p_without_waiting
from scheduler.plan import TokenLogprob

__all__ = [
    "SampleRequest", "Sampler", "SamplingParams", "adjust_logits", "stream_seed",
    "token_logprobs",
]

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def stream_seed(seed: int, output_index: int) -> int:
    """Generator seed for output token `output_index` of a request seeded `seed`.

    A mixing function rather than `hash()`: stable across processes and
    Python versions, and neighbouring (seed, k) pairs get unrelated streams.
    """
    return _splitmix64(_splitmix64(seed & _M64) ^ output_index)


@dataclass(slots=True)
class SampleRequest:
    params: SamplingParams
    # Which output token this is (0 = first); seeds the row's stream.
    output_index: int
    # Tokens that must not be sampled now (EOS and stop tokens before
    # min_tokens is reached, and the last token of a bad word the answer
    # would end with).
    banned_token_ids: Sequence[int] = field(default_factory=tuple)
    # The row's history, for the penalties (the request's own lists, not
    # copies: read only while the batch is sampled).
    prompt_token_ids: Sequence[int] = field(default_factory=tuple)
    output_token_ids: Sequence[int] = field(default_factory=tuple)
    # The tokens its grammar allows now (structured output), as an int32
    # bitmask row (`engine.structured.mask_logits`); None: any token.
    allowed: torch.Tensor | None = None

    @property
    def biased(self) -> bool:
        """Bias, bans or penalties change this row's logits."""
        return bool(self.banned_token_ids) or self.params.reweights

    @property
    def adjusts_logits(self) -> bool:
        """True when a grammar, bias, bans or penalties change this row's
        logits."""
        return self.allowed is not None or self.biased

    @property
    def fusable(self) -> bool:
        """A random row the C++ operator draws: temperature, min_p, top-k
        and top-p alone change its logits (no grammar, bias, bans or
        penalties)."""
        return not (self.adjusts_logits or self.params.greedy)

    @property
    def only_grammar(self) -> bool:
        """A grammar is the one thing that changes this row's logits."""
        return self.allowed is not None and not self.biased

    def allows(self, token: int) -> bool:
        """Whether the row's grammar (if any) allows `token` now."""
        if self.allowed is None:
            return True
        return bool((int(self.allowed[token >> 5]) >> (token & 31)) & 1)


def _apply_min_p(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    """vLLM's min_p, in place on the tempered logits: p / p_max < min_p is
    logit < max logit + ln(min_p), so no softmax is needed (ln 0 = -inf
    drops nothing)."""
    min_p = on_device([r.params.min_p for r in reqs], logits.dtype, logits.device)
    floor = logits.amax(dim=-1) + min_p.log()
    logits.masked_fill_(logits < floor.unsqueeze(1), float("-inf"))


def _long_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    # Through a typed array: about 4x faster than torch.tensor(list) on
    # Python ints, and the histories of long requests run to thousands.
    buf = array("q", values)
    if not buf:
        return torch.empty(0, dtype=torch.long, device=device)
    return staged(torch.frombuffer(buf, dtype=torch.long), device)


def _pairs(
    rows: Sequence[int], seqs: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors: every token of `seqs[j]` paired with
    `rows[j]` (flattened in C by itertools, no per-token Python code)."""
    row_ids = chain.from_iterable(repeat(r, len(s)) for r, s in zip(rows, seqs))
    return _long_tensor(row_ids, device), _long_tensor(chain.from_iterable(seqs), device)


def _unique_cells(
    rows: torch.Tensor, ids: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct flat indices `row * vocab + id` and how often each occurs."""
    return torch.unique(rows * vocab + ids, return_counts=True)


def _grammar_masks(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    rows = [i for i, r in enumerate(reqs) if r.allowed is not None]
    if not rows:
        return
    masks = torch.stack([reqs[i].allowed for i in rows])  # type: ignore[misc]
    if len(rows) < len(reqs):
        # Row-aligned with the logits; the rows without a grammar are skipped.
        full = masks.new_full((len(reqs), masks.shape[1]), -1)
        full[rows] = masks
        mask_logits(logits, full, rows)
        return
    mask_logits(logits, masks)


def _leaving_some(stage: Callable[[torch.Tensor, Sequence[SampleRequest]], None],
                  logits: torch.Tensor, reqs: Sequence[SampleRequest],
                  rows: list[int]) -> None:
    """`stage` on every row, except where it would leave one of `rows` (the
    rows it could empty) no token to sample: a request whose own
    restrictions contradict each other (its allowed tokens outside its
    grammar, or all banned by its bad words or min_tokens) keeps the row as
    it was before, rather than drawing from nothing."""
    if not rows:
        stage(logits, reqs)
        return
    at = index(rows, logits.device)
    before = logits.index_select(0, at)
    stage(logits, reqs)
    after = logits.index_select(0, at)
    # Chosen on the device: reading which rows emptied would make a GPU
    # host wait for the pass in flight.
    emptied = after.amax(dim=-1, keepdim=True) == float("-inf")
    logits.index_copy_(0, at, torch.where(emptied, before, after))


def _allowed_only(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    """vLLM's `allowed_token_ids`: every other token of the row to -inf."""
    rows = [(i, r.params.allowed_token_ids) for i, r in enumerate(reqs)
            if r.params.allowed_token_ids is not None]
    if not rows:
        return
    keep = torch.ones(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)
    at, ids = _pairs(range(len(rows)), [a for _, a in rows], logits.device)
    keep[at, ids] = False
    at = index([i for i, _ in rows], logits.device)
    logits.index_copy_(0, at, logits.index_select(0, at).masked_fill_(keep, float("-inf")))


def _add_logit_bias(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    biased = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
    if not biased:
        return
    rows, ids = _pairs([i for i, _ in biased], [list(b) for _, b in biased], logits.device)
    values = on_device(list(chain.from_iterable(b.values() for _, b in biased)),
                       logits.dtype, logits.device)
    # accumulate=True adds the bias to the logit instead of replacing it.
    logits.index_put_((rows, ids), values, accumulate=True)


def _ban_tokens(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    banned = [(i, r.banned_token_ids) for i, r in enumerate(reqs) if r.banned_token_ids]
    if not banned:
        return
    rows, ids = _pairs([i for i, _ in banned], [b for _, b in banned], logits.device)
    logits[rows, ids] = float("-inf")


def _repetition_penalty(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    sel = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
    if not sel:
        return
    seqs = [reqs[i].prompt_token_ids for i in sel] + [reqs[i].output_token_ids for i in sel]
    rows, ids = _pairs(sel + sel, seqs, logits.device)
    vocab = logits.shape[-1]
    # Deduplicated so that each seen logit is penalised once, however often
    # the token occurred; only the seen cells are touched (O(history), not
    # O(rows * vocab)).
    cells, _ = _unique_cells(rows, ids, vocab)
    penalty = on_device([r.params.repetition_penalty for r in reqs], logits.dtype,
                        logits.device)[cells // vocab]
    flat = logits.view(-1)
    seen = flat[cells]
    flat[cells] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _presence_frequency_penalties(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    sel = [
        i for i, r in enumerate(reqs)
        if (r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0)
        and r.output_token_ids
    ]
    if not sel:
        return
    rows, ids = _pairs(sel, [reqs[i].output_token_ids for i in sel], logits.device)
    vocab = logits.shape[-1]
    cells, counts = _unique_cells(rows, ids, vocab)
    row = cells // vocab
    dev, dt = logits.device, logits.dtype
    presence = on_device([r.params.presence_penalty for r in reqs], dt, dev)
    frequency = on_device([r.params.frequency_penalty for r in reqs], dt, dev)
    logits.view(-1).index_add_(0, cells, -(frequency[row] * counts.to(dt) + presence[row]))


def adjust_logits(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    """Apply the grammars' masks, `allowed_token_ids`, logit_bias, the
    min_tokens and bad words' bans and the penalties in place to the
    contiguous float logits `[rows, vocab]`, in vLLM's order."""
    if logits.shape[0] != len(reqs):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(reqs)} requests")
    if not logits.is_contiguous():
        raise ValueError("adjust_logits needs contiguous logits (it indexes the flat view)")
    _grammar_masks(logits, reqs)
    # Only a row that was restricted before can be left empty: allowed
    # tokens by a grammar, bans by allowed tokens or a grammar (min_tokens'
    # bans alone, the common case, copy nothing).
    _leaving_some(_allowed_only, logits, reqs,
                  [i for i, r in enumerate(reqs)
                   if r.params.allowed_token_ids is not None and r.allowed is not None])
    _add_logit_bias(logits, reqs)
    _leaving_some(_ban_tokens, logits, reqs,
                  [i for i, r in enumerate(reqs) if r.banned_token_ids and (
                      r.params.allowed_token_ids is not None or r.allowed is not None)])
    _repetition_penalty(logits, reqs)
    _presence_frequency_penalties(logits, reqs)


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """Log-probability of `token_ids[i]` under row i of the raw `logits`
    `[rows, vocab]`, with the row's `num_top[i]` most likely tokens, most
    likely first, and its rank.  One log_softmax and one top-k for all rows."""
    if not token_ids:
        return []
    logp = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logp.device)
    picked = logp.gather(1, ids.unsqueeze(1))
    chosen: list[float] = picked.squeeze(1).tolist()
    ranks: list[int] = ((logp > picked).sum(dim=-1) + 1).tolist()
    k = min(max(num_top), logp.shape[-1])
    if k <= 0:
        return [TokenLogprob(c, rank=r) for c, r in zip(chosen, ranks)]
    top_values, top_ids = logp.topk(k, dim=-1)
    values: list[list[float]] = top_values.tolist()
    tids: list[list[int]] = top_ids.tolist()
    return [
        TokenLogprob(c, list(zip(tids[i][:n], values[i][:n])), ranks[i])
        for i, (c, n) in enumerate(zip(chosen, num_top))
    ]


class Sampler:
    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu",
                 warm_vocab: int | None = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        if warm_vocab and self.device.type == "cuda" and top_k_top_p.SEARCH_ON_CUDA:
            # Builds the top-p cut's kernel (engine/top_k_top_p_triton.py)
            # now, not in the step of the first request that asks for it.
            top_k_top_p_without_waiting(
                torch.zeros(1, warm_vocab, device=self.device), [warm_vocab], [0.5])

    def sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest],
               exact: ExactSource | None = None) -> list[int]:
        """One token per row of `logits` `[rows, vocab]` (left unchanged):
        float32, or a CPU model's bfloat16, which is widened to float32 for
        every use but the plain greedy argmax (the same index either way).
        With `exact` (the rows' hidden states and the lm_head's weight), a
        plain greedy row whose largest value is tied takes the token of the
        largest exact logit (engine.logits_cpu)."""
        return self.sample_tensor(logits, requests, exact).tolist()

    def greedy_tensor(self, logits: torch.Tensor,
                      exact: ExactSource | None = None) -> torch.Tensor:
        """`sample_tensor` for rows that are all plain greedy (no bias,
        bans, penalties or grammar): the argmax of each row, with `exact`
        breaking a tie at the top."""
        if not logits.shape[0]:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        return argmax_rows(logits, exact)

    def sample_tensor(self, logits: torch.Tensor, requests: Sequence[SampleRequest],
                      exact: ExactSource | None = None) -> torch.Tensor:
        """`sample`, as a tensor on the logits' device.  Rows that are all
        plain greedy take one argmax with no index built on the host, so
        that on a GPU nothing here waits for the pass that computes
        `logits` (an index list copied to the device would)."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        if not requests:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        if all(r.params.greedy and not r.adjusts_logits for r in requests):
            return self.greedy_tensor(logits, exact)
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        rand = [i for i, r in enumerate(requests) if not r.params.greedy]
        fused = logits.device.type == "cpu" and attention_cpp.loaded() \
            and logits.dtype in (torch.float32, torch.bfloat16)
        plain = [i for i in rand if requests[i].fusable] if fused else []
        # A bfloat16 model's logits are widened once, only for rows that
        # need them in float32 (the operator reads them as they are).
        raw, logits = logits, (logits.float() if greedy or len(plain) < len(rand)
                               else logits)
        if greedy:
            _greedy_into(tokens, logits, greedy, requests, exact)
        if rand:
            tokens.index_copy_(0, index(rand, tokens.device),
                               self._sample_random(logits, rand, requests, raw, set(plain)))
        return tokens

    def _sample_random(
        self, logits: torch.Tensor, rows: list[int], requests: Sequence[SampleRequest],
        raw: torch.Tensor, fused: set[int],
    ) -> torch.Tensor:
        """Rows `rows`; those in `fused` (CPU, no grammar, bias, bans or
        penalties) by the C++ operator, which reads `raw` where it is."""
        reqs = [requests[i] for i in rows]
        u = self._uniforms(reqs, logits.device)
        if not fused:
            return _inverse_cdf(logits, rows, reqs, u)
        plain = [j for j, i in enumerate(rows) if i in fused]
        params = [reqs[j].params for j in plain]
        vocab = raw.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k_enabled else vocab for p in params]) \
            if any(p.top_k_enabled for p in params) else None
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32) \
            if any(p.top_p < 1.0 for p in params) else None
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32) \
            if any(p.min_p > 0.0 for p in params) else None
        out = torch.empty(len(reqs), dtype=torch.long)
        out[plain] = torch.ops.preempt_serve.sample_rows(
            raw, torch.tensor([rows[j] for j in plain], dtype=torch.long),
            torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32),
            u[plain].flatten(), top_k, top_p, min_p)
        rest = [j for j, i in enumerate(rows) if i not in fused]
        if rest:
            out[rest] = _inverse_cdf(logits, [rows[j] for j in rest], [reqs[j] for j in rest],
                                     u[rest])
        return out

    def _uniforms(self, reqs: Sequence[SampleRequest], device: torch.device) -> torch.Tensor:
        """One uniform variate per row `[rows, 1]` (float64): a seeded row's
        from its own stream, the others from the shared generator, in row
        order."""
        u = torch.empty((len(reqs), 1), dtype=torch.float64, device=device)
        unseeded = [j for j, r in enumerate(reqs) if r.params.seed is None]
        if unseeded:
            u.index_copy_(0, index(unseeded, device),
                          torch.rand((len(unseeded), 1), dtype=torch.float64,
                                     device=device, generator=self.generator))
        for j, r in enumerate(reqs):
            if r.params.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(stream_seed(r.params.seed, r.output_index))
                u[j] = torch.rand(1, dtype=torch.float64, device=device, generator=gen)
        return u


def _greedy_into(
    tokens: torch.Tensor, logits: torch.Tensor, rows: list[int],
    requests: Sequence[SampleRequest], exact: ExactSource | None = None,
) -> None:
    """Argmax of rows `rows` into `tokens`, after the adjustments of the rows
    that ask for them.  Only those rows are copied: the others' argmax reads
    the caller's logits in place (an argmax over every row reads no more
    than copying the greedy rows out would), their ties broken by `exact`.

    A row whose only adjustment is its grammar keeps its plain argmax where
    the grammar allows that token (the masked row's argmax is then the same
    token): the mask, which costs more than the argmax, is applied only to
    the rows whose favourite token the grammar refuses."""
    adjusted = [i for i in rows if requests[i].biased]
    masked = [i for i in rows if requests[i].only_grammar]
    if len(adjusted) < len(rows):
        first = [i for i in rows if not requests[i].biased]
        at = index(first, tokens.device)
        tokens.index_copy_(0, at, argmax_rows(logits, exact).index_select(0, at))
        if masked:
            picked = tokens[masked].tolist()
            adjusted += [i for i, t in zip(masked, picked) if not requests[i].allows(t)]
    if adjusted:
        at = index(adjusted, tokens.device)
        sub = logits.index_select(0, at)
        adjust_logits(sub, [requests[i] for i in adjusted])
        tokens.index_copy_(0, at, argmax_rows(sub))


def _inverse_cdf(logits: torch.Tensor, rows: list[int],
                 reqs: Sequence[SampleRequest], u: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of `logits` through every stage, then the inverse of
    each row's cumulative distribution at `u`."""
    # A copy (index_select) that is adjusted and scaled in place: the
    # caller's logits stay raw, for logprobs.
    logits = logits.index_select(0, index(rows, logits.device))
    if any(r.adjusts_logits for r in reqs):
        adjust_logits(logits, reqs)
    vocab = logits.shape[-1]
    dev = logits.device
    temps = on_device([r.params.temperature for r in reqs], torch.float32, dev)
    logits.div_(temps.unsqueeze(1))
    if any(r.params.min_p > 0.0 for r in reqs):
        _apply_min_p(logits, reqs)
    ks = [r.params.top_k if r.params.top_k_enabled else vocab for r in reqs] \
        if any(r.params.top_k_enabled for r in reqs) else None
    ps = [r.params.top_p for r in reqs] if any(r.params.top_p < 1.0 for r in reqs) else None
    if (ks or ps) and dev.type == "cuda":
        logits = top_k_top_p_without_waiting(logits, ks, ps)
    elif ks or ps:
        logits = apply_top_k_top_p(
            logits, None if ks is None else on_device(ks, torch.long, dev),
            None if ps is None else on_device(ps, torch.float32, dev))
    cdf = logits.softmax(dim=-1).to(torch.float64).cumsum_(dim=-1)
    u = u.clone()
    # The first entry whose running sum exceeds u·total: u < 1 keeps it
    # inside the row, and a zero-probability token (a flat step of the
    # sum) is never the first to exceed it.
    picked = torch.searchsorted(cdf, u.mul_(cdf[:, -1:]), right=True)
    return picked.squeeze(1).clamp_(max=vocab - 1)
