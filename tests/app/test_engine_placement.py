"""The Engine replica owns the resources of its placement-group bundle.

Ray makes a GPU visible to an actor only when the actor itself requests it;
these tests place an actor as Serve places the Engine replica (its
`ray_actor_options` in the first bundle of `engine_bundles`) on a Ray
instance that declares one GPU, which Ray accepts without the hardware.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from app.builder import engine_actor_options, engine_bundles
from api.config import AppConfig


def test_cuda_replica_takes_the_first_bundles_gpu():
    cfg = AppConfig(device="cuda")
    opts, first = engine_actor_options(cfg), engine_bundles(cfg)[0]
    assert opts["num_gpus"] == 1.0 and opts["num_gpus"] <= first["GPU"]
    assert opts["num_cpus"] <= first["CPU"]
    cpu = AppConfig()
    assert "num_gpus" not in engine_actor_options(cpu)
    assert "GPU" not in engine_bundles(cpu)[0]


_PROBE = textwrap.dedent("""
    import os, json, ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from app.builder import engine_actor_options, engine_bundles
    from api.config import AppConfig

    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, logging_level="ERROR")
    cfg = AppConfig(device="cuda")
    pg = placement_group(engine_bundles(cfg), strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)

    @ray.remote
    class Replica:
        def seen(self):
            return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                    "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    opts = engine_actor_options(cfg)
    actor = Replica.options(
        num_cpus=opts["num_cpus"], num_gpus=opts.get("num_gpus", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0)).remote()
    print(json.dumps(ray.get(actor.seen.remote(), timeout=60)))
    ray.shutdown()
""")


def test_replica_placed_like_serve_sees_its_gpu():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=240, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"gpu_ids": ["0"], "cuda_visible": "0"}
