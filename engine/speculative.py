"""A decode chunk's drafts checked against the model (speculative
decoding; the drafts come from scheduler/speculation.py).

The pass computes the logits at the chunk's last known token and at each
draft, and each of those rows samples a token as a step without drafts
would there (engine/runner_prepare.py, `_after_drafts`: by the request's
own rule, greedy or random, with the drafts before it counted as outputs
for its seed stream, bans and penalties).  A draft is accepted while it is
the token the row before it picked; at the first that is not, that row's
pick is yielded instead, and if every draft was accepted the last row's
pick comes after them.  For a greedy row this is the model's own choice;
for a random one it is speculative sampling with a draft proposed with
certainty (Leviathan et al. 2023, §2.3: accept it with probability p(draft),
else draw from p without it; drawing from p and comparing is the same
distribution), so the yielded tokens are distributed as without drafts,
and a seeded request draws each from its own stream at its own index, so
it yields the tokens it yields without drafts.  The request takes them one
by one and stops where one ends it (EOS, a stop string, `max_tokens`): the
rest are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.request import RequestState
from scheduler.plan import JobOutput, ScheduledChunk


def verified(drafts: list[int], picks: list[int], last: int) -> list[int]:
    """The tokens a chunk yields: `picks[j]` is the row's pick before
    `drafts[j]`, `last` the pick after the last draft."""
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
