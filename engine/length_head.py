"""A response-length estimate read off the served model's own state.

The separate predictor (EconoServe §3.3.2) is a second model that reads the
prompt before the engine does.  The served model reads it anyway: at the
prompt's last position, the final hidden state (after the last norm, the row
the lm_head turns into the first token's logits) carries how the model means
to answer.  A ridge regression of log(answer length) on that row and the log
of the prompt length predicts the embedded model's own answer lengths better
than the predictor does (`studies/predictor/README.md`, "The engine's length
head"), at the cost of one dot product per prompt, no second model.

The estimate exists once the prompt is computed, so it refines (or, without
the Predictor deployment, provides) the prediction when a job produces its
first token: the moment EconoServe turns a prompt task into a generation
task and allocates its answer (§3.3.1).

File format (`torch.save` of a dict of tensors and plain values, read with
`weights_only=True`): `mean`, `scale` and `weight` of the hidden size,
`prompt_coef`, `bias`, `cap` (longest length it returns), `hidden_size`,
`model` (what it was fitted on, for the error that names a mismatch) and
`fit` (how it was fitted, free-form).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.device_lists import on_device

# The head fitted on the embedded model's own answers (SmolLM2-135M-Instruct,
# `python -m studies.predictor.length_head`), shipped beside this file;
# `python -m predictor fit-head` fits a new one on a model's answers.
EMBEDDED = Path(__file__).with_name("length_heads") / "smollm2-135m-instruct.pt"


@dataclass
class LengthHead:
    mean: torch.Tensor  # [H] float32
    scale: torch.Tensor  # [H] float32, > 0
    weight: torch.Tensor  # [H] float32, on standardised features
    prompt_coef: float
    bias: float
    cap: int
    model: str = ""
    fit: dict[str, Any] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return int(self.weight.numel())

    @classmethod
    def load(cls, source: str | Path) -> LengthHead:
        """From a file; `embedded` names the one shipped for the embedded model."""
        path = EMBEDDED if str(source) == "embedded" else Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"length head {str(source)!r}: no such file")
        d = torch.load(path, map_location="cpu", weights_only=True)
        head = cls(d["mean"].float(), d["scale"].float(), d["weight"].float(),
                   float(d["prompt_coef"]), float(d["bias"]), int(d["cap"]),
                   str(d.get("model", "")), dict(d.get("fit", {})))
        if not (head.mean.shape == head.scale.shape == head.weight.shape) \
                or head.mean.dim() != 1 or int(d["hidden_size"]) != head.hidden_size:
            raise ValueError(f"length head {str(source)!r}: inconsistent shapes")
        return head

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"mean": self.mean, "scale": self.scale, "weight": self.weight,
                    "prompt_coef": self.prompt_coef, "bias": self.bias, "cap": self.cap,
                    "hidden_size": self.hidden_size, "model": self.model, "fit": self.fit},
                   path)

    def to(self, device: torch.device) -> LengthHead:
        return LengthHead(self.mean.to(device), self.scale.to(device), self.weight.to(device),
                          self.prompt_coef, self.bias, self.cap, self.model, self.fit)

    def log_length(self, hidden: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
        """Predicted log(answer length), float32 `[S]`, from the final hidden
        states `[S, H]` at the prompts' last positions."""
        z = (hidden.float() - self.mean) / self.scale
        return z @ self.weight + self.prompt_coef * prompt_lens.float().log() + self.bias

    def predict(self, hidden: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
        """Predicted answer lengths in tokens, `[S]` long, in [1, cap]."""
        est = self.log_length(hidden, prompt_lens).clamp(max=math.log(self.cap)).exp()
        return est.round().clamp(min=1).long()


def load_head(source: str | Path, hidden_size: int, split_stages: bool,
              device: torch.device) -> LengthHead:
    """The head a runner of a model of `hidden_size` uses, on `device`."""
    if split_stages:
        raise ValueError("length_head: not available with pipeline parallelism (the "
                         "last stage, not the driving one, holds the final hidden states)")
    head = LengthHead.load(source)
    if head.hidden_size != hidden_size:
        raise ValueError(f"length_head {str(source)!r} was fitted on hidden states of "
                         f"size {head.hidden_size} ({head.model or 'another model'}); "
                         f"this model's are {hidden_size}")
    return head.to(device)


def first_token_rows(head: LengthHead | None, sampled: list[Any]) -> list[int]:
    """The sampled rows of a pass (`(chunk, request state)` pairs) that
    sample their job's first token: the head estimates those."""
    if head is None:
        return []
    return [i for i, (chunk, _) in enumerate(sampled) if chunk.output_index == 0]


def first_token_lengths(head: LengthHead, hidden: torch.Tensor, sampled: list[Any],
                        rows: list[int]) -> tuple[list[str], torch.Tensor]:
    """Estimates for the sampled rows `rows` of a pass (`(chunk, request
    state)` pairs; their prompts just computed) from the pass's final hidden
    states: their job ids, and the lengths, still on the device."""
    # Staged without waiting for the pass just queued (engine.device_lists).
    staged = on_device(rows + [len(sampled[i][1].prompt_token_ids) for i in rows], torch.long,
                       hidden.device)
    index, plens = staged[:len(rows)], staged[len(rows):]
    return [sampled[i][0].job_id for i in rows], head.predict(hidden.index_select(0, index), plens)


def fit_head(hidden: torch.Tensor, prompt_lens: torch.Tensor, lengths: torch.Tensor,
             lam: float, cap: int, model: str = "") -> LengthHead:
    """Ridge regression of log(min(length, cap)) on standardised `hidden`
    `[N, H]` (penalty `lam`) and log(prompt length) (not penalised).

    An answer cut at `cap` by `max_tokens` counts as `cap`: the head
    estimates min(length, cap), which is what an allocation capped by the
    request's `max_tokens` needs, rather than a length it never saw.  (Fitting
    a censored, Tobit-style regression instead raised its error on the answers
    that ended by themselves by a quarter: studies/predictor/README.md.)"""
    x = hidden.double()
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)
    z = torch.cat([(x - mean) / scale, prompt_lens.double().log().unsqueeze(1)], 1)
    y = lengths.double().clamp(1, cap).log()
    penalty = torch.full((z.shape[1],), float(lam), dtype=torch.float64)
    penalty[-1] = 0.0
    z_mean, y0 = z.mean(0), y.mean()
    zc = z - z_mean
    w = torch.linalg.solve(zc.T @ zc + torch.diag(penalty), zc.T @ (y - y0))
    bias = float(y0 - z_mean @ w)
    return LengthHead(mean.float(), scale.float(), w[:-1].float(), float(w[-1]), bias, cap,
                      model, {"lambda": lam, "rows": int(x.shape[0]),
                              "capped": int((lengths >= cap).sum())})
