"""Batched next-token sampling: greedy, temperature, top-k, top-p, seeds.

Sampling draws one exponential variate per vocabulary entry and takes
`argmax(probs / noise)` (the exponential race, equivalent to drawing from
`probs`).  Its randomness is one vector per row, so a seeded row's noise can
come from its own generator, seeded from `(seed, output_index)`: the k-th
output token of a seeded request depends only on its logits, its seed and k,
not on which other requests share the batch, nor on whether the request was
preempted and recomputed in between (preemption transparency).  Unseeded
rows share one global generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams

__all__ = ["SampleRequest", "Sampler", "SamplingParams", "stream_seed"]

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
    # min_tokens is reached).
    banned_token_ids: Sequence[int] = field(default_factory=tuple)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus with -inf.

    top_k: `[rows]` long (vocab size = off); top_p: `[rows]` float (1 = off).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth_index = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)
        kth = sorted_logits.gather(1, kth_index)
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> list[int]:
        """One token per row of float32 `logits` `[rows, vocab]`."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        if not requests:
            return []
        if any(r.banned_token_ids for r in requests):
            logits = logits.clone()
            for i, r in enumerate(requests):
                if r.banned_token_ids:
                    logits[i, list(r.banned_token_ids)] = float("-inf")

        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        rand = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rand:
            tokens[rand] = self._sample_random(logits[rand], [requests[i] for i in rand])
        return tokens.tolist()

    def _sample_random(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        top_k = top_p = None
        if any(r.params.top_k_enabled for r in reqs):
            top_k = torch.tensor(
                [r.params.top_k if r.params.top_k_enabled else vocab for r in reqs],
                device=logits.device,
            )
        if any(r.params.top_p < 1.0 for r in reqs):
            top_p = torch.tensor([r.params.top_p for r in reqs], device=logits.device)
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)

        noise = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(reqs) if r.params.seed is None]
        if unseeded:
            draw = torch.empty((len(unseeded), vocab), device=probs.device)
            noise[unseeded] = draw.exponential_(generator=self.generator)
        for j, r in enumerate(reqs):
            if r.params.seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(stream_seed(r.params.seed, r.output_index))
                noise[j].exponential_(generator=gen)
        # A zero variate would turn a zero-probability token into 0/0.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)
