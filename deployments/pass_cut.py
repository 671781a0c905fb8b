"""An online arrival against a pure-offline pass under way (ConServe §4.3,
Algorithm 2 at the replica): set the runner's preempt flag, so that the pass
stops at its next layer boundary, unless the policy finds the pass ends soon
enough for the online prompts that arrived during it to meet their TTFT
objective after it."""

from __future__ import annotations

import time
from typing import Any


class PassCutter:
    def __init__(self, runner: Any, core: Any) -> None:
        self.runner = runner
        self.core = core
        # (start of the preemptible pass under way, online prompt tokens
        # that arrived during it): Algorithm 2 weighs them all.
        self._tally: tuple[float, int] = (0.0, 0)

    def online_arrived(self, prompt_tokens: int) -> None:
        """With no pass under way the flag is set anyway: the runner honours
        it only for a plan marked preemptible, and spends it at the end of
        every pass."""
        flag = getattr(self.runner, "preempt_flag", None)
        if flag is None:
            return
        running = getattr(self.runner, "running_pass", None)
        decide = getattr(self.core.policy, "cut_wanted", None)
        if running is None or decide is None:
            flag.set()
            return
        plan, started = running
        if self._tally[0] != started:
            self._tally = (started, 0)
        tokens = self._tally[1] + prompt_tokens
        self._tally = (started, tokens)
        if decide(plan, time.monotonic() - started, tokens):
            flag.set()
