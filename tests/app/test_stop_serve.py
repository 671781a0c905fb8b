"""`preempt-serve serve` stopping on a cluster it attached to: its own
applications go, another's keep running, and so does Serve for them."""

from __future__ import annotations

from typing import Any

from app.cli import stop_serve


def test_stopping_leaves_other_applications_running(ray_cluster: Any) -> None:
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Hello:
        def __call__(self, request: Any) -> str:
            return "hello"

    try:  # Serve left as found: other tests of this session start it as they need it
        serve.status()
        owned = False
    except Exception:
        owned = True
    serve.start(proxy_location="Disabled")
    try:
        serve.run(Hello.bind(), name="ours", route_prefix=None)
        serve.run(Hello.bind(), name="theirs", route_prefix=None)
        stop_serve(["ours"])
        apps = serve.status().applications
        assert "ours" not in apps and apps["theirs"].status == "RUNNING"
        assert serve.get_app_handle("theirs").remote(None).result(timeout_s=30) == "hello"
    finally:
        serve.delete("theirs")
        if owned:
            serve.shutdown()
