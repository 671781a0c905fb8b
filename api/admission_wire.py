"""The ingress's questions to the Scheduler deployment and its answers
(deployments/scheduler.py): where a request runs, or why it may not."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class AdmitRequest(BaseModel):
    """One request to place, as `Scheduler.admit_many` takes it: an online
    one (an offline one can wait in the offline pool, and goes by its own
    `admit` call so that it holds up no other)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    prompt_tokens: int
    max_tokens: int
    job_class: str = "online"
    # Choices: the request's prompts times its `n`.
    n: int = 1
    priority: int = 0
    # The prompt's leading blocks and the client's `prompt_cache_key`
    # (scheduler/prefix_affinity.py).
    prefix_keys: list[int] | None = None
    route_key: int | None = None


class Admission(BaseModel):
    """The Scheduler deployment's answer to "may this request run, where?"."""

    admitted: bool
    # The engine replica chosen (None: no replica has reported yet; any).
    replica: str | None = None
    # When refused: seconds after which the queued work should fit again.
    retry_after_s: float | None = None
    message: str | None = None
    # The application's only live engine replica, where it started a
    # newcomer at once when this request came: the ingress may send its
    # next online request there before that one's answer
    # (deployments/dispatch_ahead.py). None: wait for the answer.
    dispatch_ahead: str | None = None
