"""Multi-layer pooling, the head ensemble and the chat-template frame."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from predictor.config import DatasetConfig, ModelConfig, TrainConfig
from predictor.dataset import build_pairs, encode_prompts, load_tokenizer
from predictor.model import (
    HEAD_FILE,
    LengthHead,
    build_predictor,
    collate,
    decode,
    load_predictor,
    save_predictor,
)
from predictor.prompt_format import chat_frame
from predictor.train import train

from .conftest import synthetic_records


def _cfg(path: Path, **kw: object) -> ModelConfig:
    base: dict[str, object] = dict(backbone=str(path), lora_layers=2, head="bins", max_len=256, head_hidden=16)
    base.update(kw)
    return ModelConfig.model_validate(base)


def test_the_named_layers_are_pooled(tiny_llama: Path) -> None:
    """Same weights, other pooled layers: other features and another answer.
    (The prefix-cache path with pooled layers: test_prefix_cache.py.)"""
    model = build_predictor(_cfg(tiny_llama, pool_layers=(2, 4), pooling="mean+last", n_heads=3)).eval()
    assert model.head.norm.normalized_shape == (32 * 4,)  # 2 layers x (mean, last)
    other = build_predictor(_cfg(tiny_llama, pool_layers=(3, 4), pooling="mean+last", n_heads=3)).eval()
    other.backbone.load_state_dict(model.backbone.state_dict())
    other.head.load_state_dict(model.head.state_dict())
    ids, mask = collate([[5, 6, 7, 8, 9, 10], [11, 12]], 0)
    pt = torch.tensor([6, 2])
    with torch.no_grad():
        assert not torch.allclose(model(ids, mask, pt), other(ids, mask, pt), atol=1e-3)
        assert torch.equal(model(ids, mask, pt), model(ids, mask, pt))  # deterministic in eval


def test_pool_layers_below_the_frozen_prefix_are_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="pool_layers"):
        build_predictor(_cfg(tiny_llama, pool_layers=(1, 4)))  # layer 1 is under the cache
    with pytest.raises(ValueError, match="pool_layers"):
        build_predictor(_cfg(tiny_llama, pool_layers=(5,)))  # only 4 layers
    with pytest.raises(ValueError, match="pool_layers"):
        ModelConfig(pool_layers=(0,))


def test_ensemble_is_the_mixture_of_its_members() -> None:
    cfg = ModelConfig(head="bins", max_len=256, head_hidden=8, n_heads=3)
    head = LengthHead(16, cfg).eval()  # no dropout
    head.init_prior([40, 100, 100, 200], cfg)
    for net in head.nets:  # members differ
        torch.nn.init.normal_(net[-1].weight, std=0.5)
    x, pt = torch.randn(5, 16), torch.tensor([3, 10, 30, 100, 300])
    members = head.members(x, pt)
    assert members.shape == (5, 3, cfg.n_bins)
    mix = torch.softmax(head(x, pt), -1)
    assert torch.allclose(mix, torch.softmax(members, -1).mean(1), atol=1e-6)
    # The mixture's median lies between its members' medians.
    med = decode(head(x, pt), cfg, "median")
    each = torch.stack([decode(members[:, i], cfg, "median") for i in range(3)], 1)
    assert torch.all(med >= each.min(1).values - 1e-3) and torch.all(med <= each.max(1).values + 1e-3)
    # The log head averages log lengths.
    lcfg = cfg.model_copy(update={"head": "log"})
    lhead = LengthHead(16, lcfg).eval()
    assert torch.allclose(lhead(x, pt), lhead.members(x, pt).mean(1))


def test_adapter_saved_with_a_single_net_still_loads(tiny_opt: Path, tmp_path: Path) -> None:
    model = build_predictor(_cfg(tiny_opt))
    torch.nn.init.normal_(model.head.nets[0][-1].weight)
    save_predictor(model, tmp_path)
    # The former layout: one MLP called `net`.
    old = {k.replace("nets.0.", "net."): v for k, v in model.head.state_dict().items()}
    save_file(old, str(tmp_path / HEAD_FILE))
    again = load_predictor(tmp_path)
    for k, v in model.head.state_dict().items():
        assert torch.equal(again.head.state_dict()[k], v)


def test_chat_frame_wraps_the_truncated_prompt(tiny_llama_chat: Path) -> None:
    tok = load_tokenizer(str(tiny_llama_chat))
    before, after = chat_frame(tok)
    assert before and after
    prompts = ["write a short poem about the sea " * 6, "hi"]
    raw, full = encode_prompts(tok, prompts, 4, 2)
    framed, full2 = encode_prompts(tok, prompts, 4, 2, chat=True)
    assert full == full2  # lengths are the bare prompt's
    for r, f in zip(raw, framed):
        assert f == before + r + after
    # On a short prompt the frame is the template's own tokenization.
    whole = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert framed[1] == tok(whole, add_special_tokens=False)["input_ids"]
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        chat_frame(tok)


def test_training_with_chat_frame_pooled_layers_and_ensemble(tiny_llama_chat: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(tiny_llama_chat))
    s = build_pairs(synthetic_records(120), tok, DatasetConfig(tokenizer=str(tiny_llama_chat), n_finetune=80))
    cfg = _cfg(tiny_llama_chat, prompt_format="chat", pool_layers=(2, 4), pooling="mean+last",
               n_heads=2, prompt_head=12, prompt_tail=4)
    tc = TrainConfig(max_train_samples=16, batch_size=16, max_steps=25, lr=1e-2, head_lr=1e-2,
                     warmup_steps=0, eval_samples=8, checkpoint_every=0)
    summary = train(cfg, tc, s.train, s.test, tmp_path / "a", progress=False)
    losses = summary["losses"]
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5
    again = load_predictor(tmp_path / "a")
    assert again.cfg.prompt_format == "chat" and len(again.head.nets) == 2
