"""Every Triton kernel the engine launches builds for Hopper without a GPU
(tests/engine/triton_build.py, in a process without the interpreter)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def _launched_kernels() -> set[str]:
    """The `@triton.jit` functions of engine/ that some code launches
    (`name[grid](...)`), as opposed to helpers called inside kernels."""
    sources = {p: p.read_text() for p in ENGINE.rglob("*.py")}
    kernels = {m.group(1) for text in sources.values()
               for m in re.finditer(r"@triton\.jit[^\n]*\ndef (\w+)", text)}
    return {k for k in kernels
            if any(re.search(rf"(?<![\w.]){k}\[", text) for text in sources.values())}


def test_every_launched_kernel_builds_for_hopper() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.engine.triton_build"], env=env,
                          capture_output=True, text=True, timeout=900,
                          cwd=ENGINE.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    built = {line.split("(")[0] for line in done.stdout.splitlines()}
    launched = _launched_kernels()
    assert len(launched) >= 10 and "_cut_rows" in launched
    assert launched <= built, f"launched but not built: {sorted(launched - built)}"
