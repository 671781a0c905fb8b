"""What building the C++ operators (engine/attention_cpp.py) asks of the
machine: its CPU's flags, `ninja` on PATH, and a digest of the sources that
names the build."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def sources_digest(folder: Path) -> str:
    """A digest of every C++ source and header in `folder`."""
    h = hashlib.sha256()
    for p in sorted([*folder.glob("*.h"), *folder.glob("*.cpp")]):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cpu_has(flag: str) -> bool:
    """Whether Linux lists `flag` for this CPU (ATen's capability names no
    bf16 dot-product or AMX instruction)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.split()
    except OSError:
        pass
    return False


def put_ninja_on_path() -> None:
    """The `ninja` wheel (a dependency) installs its binary next to the
    interpreter, which is not on PATH where a process runs that interpreter
    without activating its environment (a Ray worker, say)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
