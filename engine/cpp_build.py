"""What building the C++ operators (engine/cpp_ops.py) asks of the
machine: its CPU's flags and which optional paths to build for them, `ninja`
on PATH, a digest of the sources that names the build, and a build directory
that one process at a time builds in."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def sources_digest(folder: Path) -> str:
    """A digest of every C++ source and header in `folder`."""
    h = hashlib.sha256()
    for p in sorted([*folder.glob("*.h"), *folder.glob("*.cpp")]):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo(field: str) -> str:
    """The value of `field` for the first CPU in /proc/cpuinfo ("" where
    there is none)."""
    try:
        with open(CPUINFO, encoding="ascii", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_has(flag: str) -> bool:
    """Whether Linux lists `flag` for this CPU (ATen's capability names no
    bf16 dot-product or AMX instruction)."""
    return flag in _cpuinfo("flags").split()


def avx512_half_width() -> bool:
    """Whether this CPU runs AVX-512 on 256-bit units: AMD's Zen 4 (family
    19h, the only one of that family with `avx512f`) splits each 512-bit
    instruction into two halves, so 512-bit vectors do no more arithmetic a
    cycle than AVX2's there (Zen 5, family 1Ah, has whole 512-bit units)."""
    return (_cpuinfo("vendor_id") == "AuthenticAMD" and _cpuinfo("cpu family") == "25"
            and cpu_has("avx512f"))


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


def build_directory(name: str) -> Path:
    """Where the build `name` lives: torch's layout for a CPU extension
    (`TORCH_EXTENSIONS_DIR` or its default root, then `py<version>_cpu`),
    given to `load` rather than read from torch's private helper; a CUDA
    build of torch would have put it under `py<version>_cu<version>`."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    return Path(root) / name


@contextmanager
def exclusive_build(folder: Path) -> Iterator[None]:
    """Build (or load) in `folder` alone, clearing the lock file a build
    that died there left.

    `torch.utils.cpp_extension.load` marks a build with a `lock` file and
    waits, with no limit, while one exists: a process killed while building
    (a replica stopped during its first start) leaves it behind, and every
    later start then waits forever.  An OS lock ends with its process, so a
    `lock` file found while holding ours was left by a builder that is gone."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "builder.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when `held` closes
        left = folder / "lock"
        if left.exists():
            log.warning("removing %s, left by a build of the C++ operators that did not "
                        "finish", left)
            left.unlink(missing_ok=True)
        yield


def bf16_dot_wanted() -> bool:
    """Whether to build bf16 scores on VDPBF16PS: where the CPU has it
    (`avx512_bf16`) and ATen runs at AVX512 (the build follows ATen's
    capability, which `ATEN_CPU_CAPABILITY` may hold lower), unless
    PREEMPT_SERVE_CPP_BF16_DOT=0."""
    return (os.environ.get("PREEMPT_SERVE_CPP_BF16_DOT", "1") != "0"
            and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and cpu_has("avx512_bf16"))


def amx_wanted() -> bool:
    """Whether to build bf16 decodes on AMX tiles (engine/csrc/paged_decode_amx.h):
    where the CPU has `amx_tile` and `amx_bf16` and the build has the bf16
    dot product, unless PREEMPT_SERVE_CPP_AMX=0."""
    return (os.environ.get("PREEMPT_SERVE_CPP_AMX", "1") != "0" and bf16_dot_wanted()
            and cpu_has("amx_tile") and cpu_has("amx_bf16"))
