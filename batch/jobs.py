"""Batch jobs as Ray Jobs: submit, look up, stop.

Each run of a batch is one Ray Job (`python -m batch.job`), submitted with
the submission id `<batch id>-<run>`: a resumed batch is a new run, since
Ray keeps a stopped job's id.  The job's driver needs no CPU of its own
(it waits on the ingress), so it takes none from the engines.
"""

from __future__ import annotations

import shlex
import threading
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

# Ray's job states that will not change any more.
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


class JobView(BaseModel):
    """What a batch's state needs of a Ray Job."""

    submission_id: str
    status: str
    message: str | None = None
    # Unix times in milliseconds, as Ray reports them.
    start_time: int | None = None
    end_time: int | None = None


class JobsUnavailable(Exception):
    """The Ray Jobs API cannot be reached (no dashboard, wrong address)."""


class Jobs(Protocol):
    """The Ray Jobs operations batches use (a fake in tests)."""

    def check(self) -> None:
        """Raise `JobsUnavailable` unless the API answers."""

    def submit(self, submission_id: str, entrypoint: str, metadata: dict[str, str]) -> None: ...

    def info(self, submission_id: str) -> JobView | None: ...

    def infos(self) -> dict[str, JobView]: ...

    def stop(self, submission_id: str) -> None: ...


def entrypoint(storage_root: Path, batch_id: str) -> str:
    return f"python -m batch.job --storage-dir {shlex.quote(str(storage_root))} {batch_id}"


class RayJobs:
    """`ray.job_submission.JobSubmissionClient` at `address` (a dashboard
    URL or a cluster address; None: the cluster this process is in),
    connected at first use."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._client: Any = None
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        with self._lock:
            if self._client is None:
                from ray.job_submission import JobSubmissionClient

                address = self.address or _own_dashboard()
                try:
                    self._client = JobSubmissionClient(address)
                except Exception as e:
                    raise JobsUnavailable(f"the Ray Jobs API at {address} cannot be reached: "
                                          f"{type(e).__name__}: {e}") from e
            return self._client

    def check(self) -> None:
        self._connect()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        client = self._connect()
        try:
            return getattr(client, method)(*args, **kwargs)
        except OSError as e:  # requests' connection errors
            raise JobsUnavailable(f"the Ray Jobs API cannot be reached: {e}") from e

    def submit(self, submission_id: str, entrypoint: str, metadata: dict[str, str]) -> None:
        self._call("submit_job", entrypoint=entrypoint, submission_id=submission_id,
                   metadata=metadata, entrypoint_num_cpus=0)

    def info(self, submission_id: str) -> JobView | None:
        try:
            return _view(self._call("get_job_info", submission_id))
        except RuntimeError as e:  # the SDK's "job does not exist"
            if "does not exist" in str(e):
                return None
            raise

    def infos(self) -> dict[str, JobView]:
        return {d.submission_id: _view(d) for d in self._call("list_jobs")
                if d.submission_id is not None}

    def stop(self, submission_id: str) -> None:
        self._call("stop_job", submission_id)


def _own_dashboard() -> str:
    """The dashboard URL of the cluster this process is connected to, read
    once from its GCS (Ray's own lookup retries for 40 s when there is
    none)."""
    from ray._private import ray_constants
    from ray.experimental import internal_kv

    url = internal_kv._internal_kv_get(ray_constants.DASHBOARD_ADDRESS,
                                       namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
    if not url:
        raise JobsUnavailable("this Ray cluster runs no dashboard, so no Ray Jobs API")
    return f"http://{url.decode()}"


def _view(details: Any) -> JobView:
    status = details.status
    return JobView(submission_id=details.submission_id,
                   status=getattr(status, "value", str(status)), message=details.message,
                   start_time=details.start_time, end_time=details.end_time)
