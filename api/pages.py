"""OpenAI's cursor pages (`limit`, `after`): a list route's answer is the
`limit` entries after the one `after` names, and whether more follow."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from api.errors import APIError

T = TypeVar("T")


def page_after(entries: Sequence[T], ids: Sequence[str], after: str | None, limit: int,
               what: str) -> tuple[list[T], bool]:
    """The page, and whether entries follow it; `ids[i]` is `entries[i]`'s.
    A 404 naming `after` where no entry (a `what`) has that id."""
    start = 0
    if after is not None:
        if after not in ids:
            raise APIError(404, f"no {what} {after[:100]!r}", "after")
        start = list(ids).index(after) + 1
    rest = entries[start:]
    return list(rest[:limit]), len(rest) > limit


def list_object(items: list[dict[str, Any]], more: bool = False) -> dict[str, Any]:
    """OpenAI's list object of a page of `items` (each with an `id`)."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": more}


def no_params(params: Mapping[str, str]) -> None:
    """A 400 naming the first of `params`, for a route that reads none."""
    if params:
        name = sorted(params)[0]
        raise APIError(400, f"{name}: unrecognized query parameter", name)
