"""One line of a batch job, answered by the ingress without HTTP.

Batch jobs (batch/job.py) call `Ingress.batch_request` through a Serve
handle.  The line's body is checked as its route checks a body and run as
offline work, whatever the line says (batch work is what `offline` is
for), answered whole (not streamed); the answer is a `BatchResponse`
dump, the OpenAI response or error body, never an exception, whatever the
line holds.  `/v1/responses` lines go to the Responses route
(`ResponsesRoute.batch_response`), `/v1/messages` lines to the Messages
route (`MessagesRoute.batch_message`; a failure's body is then
Anthropic's error).
"""

from __future__ import annotations

import logging
from typing import Any

from api.batch import BATCH_ENDPOINTS, BatchResponse
from api.errors import APIError
from api.http import check_json_tree
from api.messages_api import error_body
from api.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("ray.serve")


async def answer_line(ingress: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        if url not in BATCH_ENDPOINTS:
            raise APIError(404, f"no route {str(url)[:200]!r} for a batch", "url")
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", "body")
        check_json_tree(body)
        if url == "/v1/responses":
            out = await ingress.responses_route.batch_response(body)
        elif url == "/v1/messages":
            out = await ingress.messages_route.batch_message(body)
        else:
            out = await _completion(ingress, url == "/v1/chat/completions", body)
        return BatchResponse(status_code=200, request_id=out["id"], body=out).model_dump()
    except Exception as e:
        if isinstance(e, APIError):
            err = e
        else:
            log.exception("batch request to %s failed", str(url)[:200])
            err = APIError(500, "internal server error")
        body = error_body(err) if url == "/v1/messages" else err.body()
        return BatchResponse(status_code=err.status, body=body).model_dump()


async def _completion(ingress: Any, chat: bool, body: dict[str, Any]) -> dict[str, Any]:
    req = ingress.validate(body, ChatCompletionRequest if chat else CompletionRequest)
    if req.stream:
        raise APIError(400, "a batch request cannot be streamed", "stream")
    if chat:
        ingress.chat_store.check(req)
    req = req.model_copy(update={"job_class": "offline"})
    async with ingress.door.start(offline=True, priority=req.priority):
        started = await (ingress.start_chat(req) if chat else ingress.start_completion(req))
    answer = await ingress.collect(*started)
    if chat:
        await ingress.chat_store.keep(req, answer)
    return answer
