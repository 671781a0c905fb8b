"""An iteration's deliveries, held until the next pass is under way.

The replica's loop holds an iteration's tokens and sends them from the
runner's `on_launch`: on a GPU once the next pass and its sampling are
queued and before the host reads that pass's tokens (it would only wait
there), on a CPU just before the pass; or at once when the loop idles.
Text the runner left for later (`JobEvent.text_later`: requests without
stop strings) is decoded as they leave.  A failure to deliver is kept for
the loop to raise from its own code, where it ends the loop as any other
delivery failure does, rather than inside the runner's `execute`, where it
would fail the iteration's jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class HeldDeliveries:
    def __init__(self, deliver: Callable[[list[Any]], None]) -> None:
        self._deliver = deliver
        self._items: list[Any] = []
        self._error: Exception | None = None

    def hold(self, items: list[Any]) -> None:
        """Hold `items` (after what was held has been flushed)."""
        assert not self._items, "flush before holding the next iteration's deliveries"
        self._items = items

    def flush(self) -> None:
        """Send what is held; a failure is kept for `raise_error`."""
        items, self._items = self._items, []
        if not items:
            return
        try:
            self.send(items)
        except Exception as e:
            self._error = e

    def raise_error(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def send(self, items: list[Any]) -> None:
        """Decode the text left for later, then deliver `items` now."""
        for d in items:
            ev = d.event
            later = ev.text_later
            if later is not None:
                ev.text_later = None
                try:
                    ev.text = later()
                except Exception:  # a tokenizer error costs this delta, not the stream
                    log.exception("decoding the text of %s failed", ev.job_id)
        self._deliver(items)
