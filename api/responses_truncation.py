"""`truncation: "auto"`: a conversation too long for the context loses items
from its beginning, as OpenAI's Responses API does, so a chain of stored
responses (`previous_response_id`) keeps going once it outgrows the model.

Fewest items dropped such that the prompt leaves room for the answer: a
binary search over how many, each probe rendering the chat template and
counting its tokens (dropping items never lengthens the prompt).  A call's
output whose call was dropped goes with it (a result without its call reads
as an answer to nothing).  The last item always stays: where it alone does
not fit, the request is refused as one too long would be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api.responses_api import FunctionCallOutputItem


def _without_orphans(items: list[Any]) -> list[Any]:
    k = 0
    while k < len(items) - 1 and isinstance(items[k], FunctionCallOutputItem):
        k += 1
    return items[k:]


def fit(items: list[Any], prompt_tokens: Callable[[list[Any]], int], room: int,
        limit: int) -> list[Any]:
    """The longest end of `items` whose prompt (`prompt_tokens`) leaves
    `room` tokens of the `limit`; the last item where none does."""
    def fits(k: int) -> bool:
        return prompt_tokens(_without_orphans(items[k:])) + room <= limit

    if fits(0):
        return items
    lo, hi = 1, len(items) - 1  # fits(lo - 1) is false; hi is the last item alone
    if hi < lo or not fits(hi):
        return items[-1:]
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return _without_orphans(items[lo:])
