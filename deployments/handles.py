"""Serve handles whose calls travel over Serve's gRPC data plane.

By default a Serve handle call is a Ray actor task: its arguments and every
item a streaming call yields go through Ray's object store and task
machinery, about a millisecond of the caller's and the callee's CPU each.
Every replica of a recent Ray Serve also runs a gRPC server for calls
between deployments; a handle with `_by_reference=False` sends its calls,
and receives a stream's items, over it, by value (what Ray Serve's
throughput-optimized mode, RAY_SERVE_THROUGHPUT_OPTIMIZED, turns on for all
handles). On a 2-core CPU the ingress took half the CPU per streamed request
and the engine's core about 5 % less (studies/serve_path/README.md).

A replica that dies mid-call surfaces as `ActorUnavailableError`, a
`RayActorError`, as before, so a stream resumes elsewhere the same way
(deployments/resume.py). Ray versions whose handles lack the option keep
the actor-task path.
"""

from __future__ import annotations

from typing import Any


def by_value(handle: Any) -> Any:
    """`handle` with its calls sent over the replicas' gRPC data plane, or
    `handle` itself where this Ray Serve cannot (no `_by_reference` option);
    None (a deployment the application does not have) stays None."""
    if handle is None:
        return None
    try:
        return handle.options(_by_reference=False)
    except TypeError:
        return handle
