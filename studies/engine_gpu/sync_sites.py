"""Where the serving loop makes the host wait for the GPU: PyTorch's sync
debug mode (`torch.cuda.set_sync_debug_mode("warn")`) warns at every CUDA
operation that synchronizes (an `.item()`, a `nonzero`, a copy to or from
pageable memory, ...); this counts those warnings by the innermost frame of
the repository's own code that made the call, and by thread.

    sites = SyncSites(root)
    sites.start()   # on a CUDA machine
    ...             # the loop serves
    sites.stop()
    sites.summary()  # {"total", "by_site": [{"site", "thread", "count"}, ...]}

Used by `engine_loop --sync-sites`; on a CPU nothing warns.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

# The text PyTorch gives the warning (c10/cuda/CUDAFunctions.cpp).
MESSAGE = "called a synchronizing CUDA operation"


class SyncSites:
    def __init__(self, root: Path) -> None:
        self.root = str(root.resolve())
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._shown: Any = None
        self._saved: warnings.catch_warnings | None = None

    def record(self, message: str, stack: list[traceback.FrameSummary]) -> bool:
        """Count one warning if it is a synchronization; False otherwise."""
        if MESSAGE not in message:
            return False
        site = "outside the repository"
        for frame in reversed(stack):
            if frame.filename.startswith(self.root) and frame.filename != __file__:
                rel = Path(frame.filename).relative_to(self.root)
                site = f"{rel}:{frame.lineno} {frame.name}"
                break
        with self._lock:
            self.counts[(site, threading.current_thread().name)] += 1
        return True

    def _show(self, message: Any, category: type[Warning], filename: str, lineno: int,
              file: Any = None, line: str | None = None) -> None:
        if not self.record(str(message), traceback.extract_stack()[:-1]):
            self._shown(message, category, filename, lineno, file, line)

    def start(self) -> None:
        # Filters and showwarning as they were, put back by stop().
        self._saved = warnings.catch_warnings()
        self._saved.__enter__()
        self._shown = warnings.showwarning
        warnings.showwarning = self._show
        # Every occurrence, not once per place.
        warnings.filterwarnings("always", message=f".*{MESSAGE}.*")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._saved = None

    def summary(self, top: int = 40) -> dict[str, Any]:
        with self._lock:
            ranked = self.counts.most_common(top)
            total = sum(self.counts.values())
        return {"total": total,
                "by_site": [{"site": s, "thread": t, "count": n} for (s, t), n in ranked]}
