"""The C++ operators' build directory, built in by one process at a time
(engine/cpp_build.py): a lock file that a killed build left behind no longer
makes every later start wait forever."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import cpp_build
from engine.cpp_build import build_directory, exclusive_build

REPO = Path(__file__).parents[2]


def test_a_lock_file_left_by_a_dead_build_is_cleared(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()  # what torch's builder leaves when killed mid-build
    with exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_build_under_way_is_waited_for_and_its_lock_left_alone(tmp_path: Path) -> None:
    order: list[str] = []
    building = threading.Event()

    def builder() -> None:
        with exclusive_build(tmp_path):
            (tmp_path / "lock").touch()  # torch's marker while it builds
            order.append("build starts")
            building.set()
            time.sleep(0.3)
            assert (tmp_path / "lock").exists()
            (tmp_path / "lock").unlink()
            order.append("build ends")

    t = threading.Thread(target=builder)
    t.start()
    assert building.wait(10)
    with exclusive_build(tmp_path):
        order.append("second enters")
    t.join()
    assert order == ["build starts", "build ends", "second enters"]


@pytest.fixture
def planted_locks() -> Iterator[list[Path]]:
    """Lock files planted in this machine's real build directories, removed
    after the test whatever happens (one left there would stall later tests)."""
    planted: list[Path] = []
    yield planted
    for p in planted:
        p.unlink(missing_ok=True)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="no C++ compiler")
def test_the_operators_load_past_a_lock_a_killed_build_left(planted_locks: list[Path]) -> None:
    import torch

    name = f"preempt_serve_paged_decode_{torch.backends.cpu.get_cpu_capability().lower()}"
    for suffix in ("", "_bf16", "_bf16_amx"):  # whichever this CPU builds
        folder = build_directory(name + suffix)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "lock").touch()
        planted_locks.append(folder / "lock")
    # A fresh process, as a replica starting after one was killed mid-build.
    done = subprocess.run(
        [sys.executable, "-c", "from engine.attention_cpp import load_kernel; load_kernel()"],
        cwd=REPO, timeout=900, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "did not finish" in done.stderr


@pytest.mark.parametrize("vendor,family,flags,half", [
    ("AuthenticAMD", "25", "fma avx2 avx512f avx512_bf16", True),  # Zen 4
    ("AuthenticAMD", "25", "fma avx2", False),  # Zen 3: no AVX-512 at all
    ("AuthenticAMD", "26", "fma avx2 avx512f avx512_bf16", False),  # Zen 5: whole units
    ("GenuineIntel", "6", "fma avx2 avx512f", False),
])
def test_avx512_on_half_width_units_is_told_from_cpuinfo(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        vendor: str, family: str, flags: str, half: bool) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
                    f"model\t\t: 17\nflags\t\t: fpu {flags}\n\nprocessor\t: 1\n")
    monkeypatch.setattr(cpp_build, "CPUINFO", info)
    assert cpp_build.avx512_half_width() is half
    assert cpp_build.cpu_has("avx2") and not cpp_build.cpu_has("avx")
    monkeypatch.setattr(cpp_build, "CPUINFO", tmp_path / "missing")
    assert not cpp_build.avx512_half_width() and not cpp_build.cpu_has("avx2")
