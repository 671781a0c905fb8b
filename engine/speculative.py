"""A decode chunk's drafts checked against the model (speculative
decoding; the drafts come from scheduler/speculation.py).

The pass computes the logits at the chunk's last known token and at each
draft.  Greedy verification: a draft is accepted while it is the token the
model picks at the position before it (by the sampler's own greedy rule,
ties broken as for any greedy row); the chunk then yields the accepted
drafts and the model's pick after the last of them, so every token it
yields is the one a step without drafts would have produced.  The request
takes them one by one and stops where one ends it (EOS, a stop string,
`max_tokens`): the rest are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.request import RequestState
from scheduler.plan import JobOutput, ScheduledChunk


def verified(drafts: list[int], picks: list[int], last: int) -> list[int]:
    """The tokens a chunk yields: `picks[j]` is the model's token before
    `drafts[j]`, `last` its token after the last draft."""
    for j, (draft, pick) in enumerate(zip(drafts, picks)):
        if draft != pick:
            return drafts[:j] + [pick]
    return drafts + [last]


def speculative_output(chunk: ScheduledChunk, state: RequestState, picks: list[int],
                       last: int, max_model_len: int, later: bool) -> JobOutput:
    """`state` takes the tokens `chunk` yields until one ends it; its
    output, with all but the last taken as `accepted`."""
    taken: list[int] = []
    texts: list[str] = []
    decodes: list[Callable[[], str]] = []
    reason = None
    for token in verified(chunk.token_ids[-chunk.draft:], picks, last):
        taken.append(token)
        if later:
            decode, reason = state.append_later(token, max_model_len)
            decodes.append(decode)
        else:
            text, reason = state.append(token, max_model_len)
            texts.append(text)
        if reason is not None:
            break
    return JobOutput(chunk.job_id, taken[-1], reason, "".join(texts),
                     text_later=(lambda: "".join(d() for d in decodes)) if later else None,
                     stop_reason=state.stop_reason, accepted=taken[:-1])
