"""Cache of the frozen bottom layers' outputs, so training pays for them once.

With LoRA only on the top `lora_layers` layers, the layers below have no
trainable weight: their output for a prompt never changes during training.
On a CPU budget that forward pass dominates (it is repeated every epoch and at
every learning-curve evaluation), so it is computed once per dataset and kept
(float16) in memory and on disk under `config.cache_dir()/prefix`.

Exactness: prompts are right-padded, so under the causal mask a real token
never attends to a pad and its hidden state does not depend on its batch.  The
cached state of layer K-1 is fed back by swapping layers 0..K-1 for stubs (the
last returns the cached state) and running the backbone's own forward: the
embeddings, masks and positions (RoPE for Llama, learned for OPT) are computed
by the model itself, so the top layers see the full model's states, rounded
to float16 by the cache.  tests/predictor/test_prefix_cache.py checks this
(within float16's tolerance).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from predictor.model import collate, decoder_layers, device_of


class _StopForward(Exception):
    """Raised by the capture hook: nothing above layer K-1 needs to run."""


class _Skip(nn.Module):
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class _Inject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.states: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.states is not None
        return self.states.to(hidden_states.dtype)


@torch.no_grad()
def prefix_states(
    backbone: nn.Module, k: int, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Output of decoder layer k-1 (the last frozen one) for a right-padded batch."""
    layers = decoder_layers(backbone)
    captured: dict[str, torch.Tensor] = {}

    def hook(_mod: nn.Module, _args: Any, output: Any) -> None:
        captured["h"] = output[0] if isinstance(output, tuple) else output
        raise _StopForward

    handle = layers[k - 1].register_forward_hook(hook)
    try:
        backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _StopForward:
        pass
    finally:
        handle.remove()
    return captured["h"]


@contextmanager
def injected(backbone: nn.Module, k: int, states: torch.Tensor) -> Iterator[None]:
    """Run `backbone` with layers 0..k-1 replaced by the cached `states`."""
    layers = decoder_layers(backbone)
    saved = [layers[i] for i in range(k)]
    inject = _Inject()
    inject.states = states
    try:
        for i in range(k - 1):
            layers[i] = _Skip()
        layers[k - 1] = inject
        yield
    finally:
        for i, layer in enumerate(saved):
            layers[i] = layer


class PrefixCache:
    """Per-prompt float16 states of layer K-1, keyed by the token ids."""

    def __init__(self, k: int, states: dict[str, torch.Tensor]) -> None:
        self.k = k
        self.states = states

    @staticmethod
    def key(ids: Sequence[int]) -> str:
        return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()

    def batch(self, ids: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> torch.Tensor:
        """Right-padded (B, L, H) float32 states for a batch of prompts, on `device`."""
        rows = [self.states[self.key(x)] for x in ids]
        n = max(r.shape[0] for r in rows)
        out = torch.zeros(len(rows), n, rows[0].shape[1])
        for i, r in enumerate(rows):
            out[i, : r.shape[0]] = r.float()
        return out.to(device)

    @classmethod
    def build(
        cls,
        backbone: nn.Module,
        k: int,
        prompts: Sequence[Sequence[int]],
        pad_id: int,
        path: Path | None = None,
        batch_size: int = 32,
        desc: str = "prefix cache",
    ) -> "PrefixCache":
        """States for `prompts`, reusing (and extending) the file at `path`."""
        from safetensors.torch import load_file, save_file

        states: dict[str, torch.Tensor] = {}
        if path is not None and path.is_file():
            states = dict(load_file(str(path)))
        todo = {cls.key(x): list(x) for x in prompts if cls.key(x) not in states}
        order = sorted(todo.values(), key=len)  # similar lengths: little padding
        was_training = backbone.training
        backbone.eval()
        dev = device_of(backbone)
        for i in tqdm(range(0, len(order), batch_size), desc=desc, disable=not order):
            chunk = order[i : i + batch_size]
            input_ids, mask = collate(chunk, pad_id)
            h = prefix_states(backbone, k, input_ids.to(dev), mask.to(dev)).to(torch.float16).cpu()
            for j, x in enumerate(chunk):
                states[cls.key(x)] = h[j, : len(x)].contiguous()
        backbone.train(was_training)
        if path is not None and todo:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file(states, str(tmp))
            tmp.replace(path)
        return cls(k, states)


def cache_path(root: Path, model_cfg_json: str, k: int) -> Path:
    """One cache file per (backbone, depth, truncation, K)."""
    h = hashlib.sha256(f"{model_cfg_json}|{k}".encode()).hexdigest()[:12]
    return root / "prefix" / f"prefix-{h}.safetensors"
