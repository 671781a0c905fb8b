"""The JSON report a micro-benchmark writes (`bench/plan_time.py`,
`bench/sampling_bench.py`, `bench/step_inputs.py`, `bench/step_profile.py`,
`bench/structured_bench.py`): its settings and the machine it ran on beside
its results."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def machine_meta() -> dict[str, Any]:
    meta: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch
    except ImportError:  # the scheduler-only benchmarks need no torch
        return meta
    meta.update(torch=torch.__version__, cpu_capability=torch.backends.cpu.get_cpu_capability())
    return meta


def write_report(doc: dict[str, Any], path: Path | None) -> None:
    """Write `doc` as indented JSON to `path` (if given) and say so."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
