"""The per-request record shared by live runs and the simulator.

A live run (bench/client.py) and a simulated run (bench/simulator.py) both
produce one `RequestRecord` per request, and every metric and plot is
computed from these records by the same code (bench/metrics.py), so a
simulated figure and a measured one mean exactly the same thing.

All times are seconds on the run's own clock: 0 is the start of the run
(the wall clock in a live run, the virtual clock in the simulator).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

JobClassName = Literal["online", "offline"]
# Where a client hung up on purpose (bench/disconnects.py, soak mixes):
# right after the request was written, after the response headers but
# before the first token, or after one or more tokens.
DropPhase = Literal["after_send", "before_first_chunk", "mid_stream"]
DROP_PHASES: tuple[DropPhase, ...] = get_args(DropPhase)


class RequestRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str
    job_class: JobClassName = "online"
    # When the workload meant the request to arrive, and when it was sent
    # (equal in the simulator; a live client can lag under load).
    scheduled_time: float
    send_time: float
    # Arrival time of each streamed output token (one per SSE chunk that
    # carries a token; all tokens of one simulated iteration share a time).
    token_times: list[float] = Field(default_factory=list)
    # When the response ended ([DONE] received, the job finished, the
    # server's refusal arrived or the client hung up).
    end_time: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    # Output length the workload asked for (max_tokens with ignore_eos).
    expected_output_tokens: int | None = None
    error: str | None = None
    # Refused by admission control (HTTP 429): not an error, the server
    # protecting itself; `retry_after` is its Retry-After header (seconds).
    rejected: bool = False
    retry_after: float | None = None
    # 429s answered before the attempt recorded here, when the client
    # retries refused requests (ClientConfig.retry_rejected).
    num_rejections: int = 0
    # The client hung up on purpose at this phase (not an error either).
    dropped: DropPhase | None = None
    # Prompt tokens the server found cached (`usage.prompt_tokens_details`).
    cached_tokens: int | None = None
    # The first choice's generated token ids in the order they streamed,
    # where the request asked for them (`return_token_ids`); None otherwise.
    token_ids: list[int] | None = None

    # Reported by our server (response metadata) or by the simulator;
    # None when the system under test does not say (FastServe Figs. 1, 15b).
    num_preemptions: int | None = None
    queueing_time: float | None = None
    execution_time: float | None = None
    swap_time: float | None = None
    swap_bytes: int | None = None
    # The server's response-length prediction for this request, where it
    # reports one (ours: `metrics.predicted_output_len`, when the predictor
    # answered in time); `bench simulate --predictions-from` replays it.
    predicted_output_tokens: int | None = None
    # Seconds from the request reaching its engine to that prediction
    # landing there (ours: `metrics.prediction_delay`).
    prediction_delay_s: float | None = None

    @property
    def ok(self) -> bool:
        """Admitted and served to the end."""
        return (self.error is None and self.end_time is not None and not self.rejected
                and self.dropped is None)

    @property
    def e2e(self) -> float | None:
        if self.end_time is None:
            return None
        return self.end_time - self.send_time

    @property
    def ttft(self) -> float | None:
        if not self.token_times:
            return None
        return self.token_times[0] - self.send_time
