"""OpenAI's Conversations API shapes (`/v1/conversations`): a conversation
is a list of items (messages, function calls and their outputs) that a
Response named by `conversation` reads as its context and adds its input
and output to (deployments/responses_route.py); the store is
api/conversation_store.py, the routes api/conversations_route.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.batch import Metadata
from api.responses_api import InputItem

# OpenAI's bound on the items one request adds.
MAX_ADDED = 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ConversationCreate(_Strict):
    """`POST /v1/conversations`."""

    items: list[InputItem] | None = Field(None, max_length=MAX_ADDED)
    metadata: Metadata | None = Field(None, max_length=16)


class ConversationUpdate(_Strict):
    """`POST /v1/conversations/{id}`: its metadata, replaced whole."""

    metadata: Metadata = Field(..., max_length=16)


class ItemsCreate(_Strict):
    """`POST /v1/conversations/{id}/items`."""

    items: list[InputItem] = Field(..., min_length=1, max_length=MAX_ADDED)


class ItemsQuery(BaseModel):
    """`GET /v1/conversations/{id}/items`'s query."""

    model_config = ConfigDict(extra="forbid")

    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


def conversation_object(conv_id: str, created_at: int, metadata: dict[str, str]
                        ) -> dict[str, Any]:
    return {"id": conv_id, "object": "conversation", "created_at": created_at,
            "metadata": metadata}
