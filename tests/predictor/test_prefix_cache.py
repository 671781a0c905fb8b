"""The cached-prefix forward is the full forward (OPT and Llama, padded batches)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from predictor.config import ModelConfig
from predictor.model import build_predictor, collate, decoder_layers
from predictor.prefix_cache import PrefixCache, injected


# Pooling layer 2, the top of the frozen prefix, reads the cached state itself
# (with the cache, the stub standing at layer 2 returns it).
POOLED = {"pool_layers": (2, 4), "pooling": "mean+last", "n_heads": 3}


@pytest.mark.parametrize("extra", [{}, POOLED], ids=["final-state", "pooled-layers"])
@pytest.mark.parametrize("family", ["tiny_opt", "tiny_llama"])
def test_injected_forward_matches_full(
    family: str, extra: dict, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    path: Path = request.getfixturevalue(family)
    cfg = ModelConfig(backbone=str(path), lora_layers=2, head="bins", max_len=256, head_hidden=16, **extra)
    model = build_predictor(cfg).eval()
    # Non-zero LoRA B so the adapted top layers matter.
    with torch.no_grad():
        for name, p in model.backbone.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert len(decoder_layers(model.backbone)) == 4
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    cache = PrefixCache.build(model.backbone, 2, prompts, pad_id=0, path=tmp_path / "c.safetensors")
    assert cache.k == 2 and (tmp_path / "c.safetensors").is_file()
    ids, mask = collate(prompts, 0)
    pt = torch.tensor([6, 2, 3])
    with torch.no_grad():
        full = model(ids, mask, pt)
        with injected(model.backbone, 2, cache.batch(prompts)):
            fast = model(ids, mask, pt)
        again = model(ids, mask, pt)  # the real layers are back
    assert torch.allclose(full, fast, atol=1e-2, rtol=1e-3)  # float16 cache
    assert torch.equal(full, again)
    # A prompt's state does not depend on its batch (right padding).
    alone = PrefixCache.build(model.backbone, 2, prompts[1:2], pad_id=0)
    assert torch.allclose(alone.states[PrefixCache.key(prompts[1])].float(),
                          cache.states[PrefixCache.key(prompts[1])].float(), atol=1e-3)
    # Reloading from disk reuses the stored states.
    reloaded = PrefixCache.build(model.backbone, 2, prompts, pad_id=0, path=tmp_path / "c.safetensors")
    assert set(reloaded.states) == set(cache.states)


def test_depth_cut(tiny_llama: Path) -> None:
    model = build_predictor(ModelConfig(backbone=str(tiny_llama), depth=2, lora_layers=1, max_len=256))
    assert len(decoder_layers(model.backbone)) == 2
    names = [n for n, p in model.backbone.named_parameters() if p.requires_grad]
    assert names and all(".layers.1." in n for n in names)  # LoRA only on the top layer
    ids, mask = collate([[3, 4, 5]], 0)
    out = model(ids, mask, torch.tensor([3]))
    assert out.shape == (1, 8)
