"""`preempt-serve serve` stopping on a cluster it attached to (app/cli.py's
`stop_serve`): its own applications go, others' keep running, and so does
Serve for them.  On the session's Serve, which the `server` fixture holds."""

from __future__ import annotations

from typing import Any

from app.cli import stop_serve


def test_stopping_leaves_other_applications_running(server: str) -> None:
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Hello:
        def __call__(self, request: Any) -> str:
            return "hello"

    try:
        serve.run(Hello.bind(), name="ours", route_prefix=None)
        serve.run(Hello.bind(), name="theirs", route_prefix=None)
        stop_serve(["ours"])
        apps = serve.status().applications
        assert "ours" not in apps
        assert apps["theirs"].status == "RUNNING" and apps["llm"].status == "RUNNING"
        assert serve.get_app_handle("theirs").remote(None).result(timeout_s=30) == "hello"
    finally:
        serve.delete("theirs")
