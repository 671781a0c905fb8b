"""Served completions, recorded for the length predictor to retrain on.

EconoServe's predictor "undergoes continual retraining in the system"
(§3.3.2).  Each Ingress replica appends one JSON line per finished choice to
`served-<pid>.jsonl` in `predictor.record_dir`: the text the predictor read
(the prompt, or a chat's last user message), the prompt's token ids as the
engine computed them (chat template included: what `python -m predictor
fit-head` reads), the answer's length in tokens and how it ended.  The length counts the answer's tokens before the token
that ended it (end of sequence or a stop token), as the ShareGPT lengths
the predictor was trained on do.  An answer cut by `max_tokens` (`"censored": true`) is
not an answer length, only a lower bound of one: `python -m predictor
retrain` leaves it out.  Requests whose length the client forced
(`ignore_eos`, `min_tokens`), structured-output requests and requests to a
LoRA adapter are not recorded: the predictor learns the base model's
unconstrained answers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from api.responses import ResponseBuilder


class ServedLog:
    def __init__(self, folder: str, eos_ids: set[int]) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path = Path(folder) / f"served-{os.getpid()}.jsonl"
        self.eos_ids = frozenset(eos_ids)

    def rows(self, texts: list[str], builder: ResponseBuilder,
             stop_token_ids: list[int] | None = None) -> list[dict[str, Any]]:
        """A record per choice that ended by itself or at `max_tokens`."""
        ends = self.eos_ids.union(stop_token_ids or ())
        return [
            {"id": f"{builder.request_id}/{c.index}", "prompt": texts[c.prompt],
             "prompt_ids": builder.prompts[c.prompt].token_ids,
             "output_len": c.num_tokens - int(c.finish_reason == "stop"
                                              and c.last_token in ends),
             "finish_reason": c.finish_reason, "censored": c.finish_reason == "length"}
            for c in builder.choices if c.finish_reason in ("stop", "length")
        ]

    def write(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            with self.path.open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
