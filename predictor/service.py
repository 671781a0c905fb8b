"""Inference wrapper: backbone + adapter + head, batched predictions.

Used by the Ray Serve deployment (deployments/predictor.py) and by the latency
benchmark.  LoRA weights are merged into the backbone at load time, so a
prediction costs one plain forward pass of the (cut) backbone.

The allocation follows EconoServe §2.3/§3.3.2: the predicted RL plus a padding
ratio (15 % is the ShareGPT sweet spot of Figure 4), which the scheduler turns
into KV blocks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from predictor.dataset import encode_prompts, load_tokenizer, model_inputs
from predictor.metrics import allocation
from predictor.ensemble import adapter_meta, load_any
from predictor.model import collate, decode, pad_id_of

# Only the files the server loads ship in the package (pyproject package-data);
# how it was trained and scored: studies/predictor/smollm2-sharegpt, in the repository.
DEFAULT_ADAPTER = Path(__file__).parent / "adapters" / "smollm2-sharegpt"
DEFAULT_PADDING = 0.15  # EconoServe's ShareGPT sweet spot (§2.3, Fig. 4)


class Prediction(BaseModel):
    predicted_len: int  # tokens, >= 1
    allocation: int  # predicted_len padded by the ratio, >= predicted_len


class PredictorService:
    """Loads a trained adapter (or ensemble) once and predicts RLs for batches of prompts."""

    def __init__(
        self,
        adapter_dir: str | Path | None = None,
        backbone: str | None = None,
        padding_ratio: float = DEFAULT_PADDING,
        max_batch_size: int = 16,
        num_threads: int | None = None,
        merge_lora: bool = True,
        max_tokens_per_forward: int = 512,
        device: str = "cpu",
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.adapter_dir = Path(adapter_dir) if adapter_dir else DEFAULT_ADAPTER
        self.padding_ratio = padding_ratio
        self.max_batch_size = max_batch_size
        self.max_tokens_per_forward = max_tokens_per_forward
        model = load_any(self.adapter_dir, backbone=backbone)
        if merge_lora:
            model.merge_lora()
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.cfg = model.cfg
        self.tokenizer = load_tokenizer(self.cfg.backbone)
        self.pad_id = pad_id_of(self.tokenizer)
        # The prompt-length feature counts the *served* model's tokens; that
        # tokenizer is recorded with the adapter when it differs from the backbone's.
        lt = adapter_meta(self.adapter_dir).get("length_tokenizer")
        self.length_tokenizer = (
            load_tokenizer(lt) if lt and lt != self.cfg.backbone else self.tokenizer
        )

    @torch.inference_mode()
    def predict_lengths(
        self, prompts: Sequence[str], prompt_tokens: Sequence[int] | None = None
    ) -> list[int]:
        """Predicted RL (tokens, >= 1) for each prompt."""
        if not prompts:
            return []
        ids, full = model_inputs(self.tokenizer, prompts, self.cfg)
        if prompt_tokens is None:
            if self.length_tokenizer is self.tokenizer:
                prompt_tokens = full
            else:
                _, prompt_tokens = encode_prompts(self.length_tokenizer, prompts, 1, 0)
        out = [0] * len(ids)
        for chunk in self._chunks([len(x) for x in ids]):
            input_ids, mask = (t.to(self.device) for t in collate([ids[i] for i in chunk], self.pad_id))
            pt = torch.tensor([int(prompt_tokens[i]) for i in chunk], device=self.device)
            head = self.model(input_ids, mask, pt)
            for i, x in zip(chunk, decode(head, self.cfg).tolist()):
                out[i] = max(1, int(round(x)))
        return out

    def _chunks(self, lengths: Sequence[int]) -> list[list[int]]:
        """Forward passes for one request batch: similar lengths together.

        On a CPU the cost is per token, padded ones included, so a batch of
        mixed lengths is split (sorted by length) into passes of at most
        `max_tokens_per_forward` padded tokens and `max_batch_size` prompts.
        """
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        chunks: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            # sorted ascending: lengths[i] is the longest in `cur + [i]`
            if cur and (
                (len(cur) + 1) * lengths[i] > self.max_tokens_per_forward
                or len(cur) >= self.max_batch_size
            ):
                chunks.append(cur)
                cur = []
            cur.append(i)
        if cur:
            chunks.append(cur)
        return chunks

    def predict(
        self, prompts: Sequence[str], prompt_tokens: Sequence[int] | None = None
    ) -> list[Prediction]:
        return [
            Prediction(predicted_len=n, allocation=allocation(n, self.padding_ratio))
            for n in self.predict_lengths(prompts, prompt_tokens)
        ]

    def predict_dicts(self, prompts: Sequence[str]) -> list[dict[str, int]]:
        return [p.model_dump() for p in self.predict(prompts)]

    def info(self) -> dict[str, Any]:
        return {
            "adapter": str(self.adapter_dir),
            "device": str(self.device),
            "padding_ratio": self.padding_ratio,
            "max_batch_size": self.max_batch_size,
            "model": self.cfg.model_dump(),
        }


def bench_latency(
    service: PredictorService,
    prompts: Sequence[str],
    batch_sizes: Sequence[int] = (1, 16),
    reps: int = 10,
) -> list[dict[str, float]]:
    """Wall time per batch and per prediction at each batch size.

    Every batch size runs the same pool of `max(batch_sizes) * reps` prompts
    (after a warm-up), so the figures compare like with like.
    """
    pool = [prompts[i % len(prompts)] for i in range(max(batch_sizes) * reps)]
    ids, _ = model_inputs(service.tokenizer, pool, service.cfg)
    service.max_batch_size = max(service.max_batch_size, *batch_sizes)
    rows: list[dict[str, float]] = []
    for bs in batch_sizes:
        service.predict_lengths(pool[:bs])  # warm-up
        times: list[float] = []
        for s in range(0, len(pool), bs):
            t0 = time.perf_counter()
            service.predict_lengths(pool[s : s + bs])
            times.append(time.perf_counter() - t0)
        total = sum(times)
        times.sort()
        rows.append(
            {
                "batch_size": bs,
                "prompts": len(pool),
                "median_batch_ms": 1000 * times[len(times) // 2],
                "ms_per_prediction": 1000 * total / len(pool),
                "min_batch_ms": 1000 * times[0],
                "max_batch_ms": 1000 * times[-1],
                "threads": torch.get_num_threads(),
                "device": str(service.device),
                "mean_input_tokens": sum(len(x) for x in ids) / max(1, len(ids)),
                "loadavg_1m": os.getloadavg()[0],  # other work on the machine inflates these
            }
        )
    return rows
