"""The layer probe on a tiny Llama: features per layer, heads, the report."""

from __future__ import annotations

from pathlib import Path

import torch

from predictor.config import DatasetConfig, ModelConfig
from predictor.dataset import build_pairs, load_tokenizer
from predictor.model import load_backbone
from predictor.prompt_format import chat_frame
from studies.predictor.probe import (
    PERCEPTION_INSTRUCTION,
    ProbeConfig,
    features,
    perception_frame,
    render_probe,
    run_probe,
)

from .conftest import synthetic_records


def test_features_are_the_pooled_layer_outputs(tiny_llama: Path) -> None:
    backbone = load_backbone(ModelConfig(backbone=str(tiny_llama))).eval()
    ids = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    f = features(backbone, ids, pad_id=0, layers=[2, 4], batch_size=2)
    assert set(f) == {(2, "mean"), (2, "last"), (4, "mean"), (4, "last")}
    # A prompt's features do not depend on its batch (right padding).
    one = features(backbone, ids[1:2], pad_id=0, layers=[4])
    assert torch.allclose(f[(4, "last")][1], one[(4, "last")][0], atol=1e-5)
    assert torch.allclose(f[(4, "mean")][1], one[(4, "mean")][0], atol=1e-5)
    # Last = the state at the prompt's last real token, mean = over real tokens.
    assert not torch.allclose(f[(4, "last")][1], f[(4, "mean")][1])
    assert not torch.allclose(f[(2, "mean")], f[(4, "mean")])


def test_probe_reports_every_feature_set(tiny_llama: Path) -> None:
    tok = load_tokenizer(str(tiny_llama))
    s = build_pairs(synthetic_records(200), tok, DatasetConfig(tokenizer=str(tiny_llama), n_finetune=160))
    cfg = ProbeConfig(backbone=str(tiny_llama), formats=("raw",), layers=(2, 4), combos=((2, 4),),
                      epochs=3, head_hidden=16, prompt_head=12, prompt_tail=4)
    report = run_probe(cfg, s.train, s.test)
    names = [r["features"] for r in report["rows"]]
    assert names == ["L2 mean", "L2 last", "L4 mean", "L4 last", "L2+4 mean+last"]
    assert report["n_fit"] + report["n_val"] == len(s.train) and report["n_test"] == len(s.test)
    for r in report["rows"]:
        assert r["mae"] > 0 and 0 <= r["acc50"] <= r["acc100"] <= 1 and 1 <= r["epochs"] <= 3
    md = render_probe(report, "python -m studies.predictor probe")
    assert "'perception'" in md
    assert "L2+4 mean+last" in md and "bucket median" in md


def test_perception_frame_closes_the_user_message_with_the_instruction(tiny_llama_chat: Path) -> None:
    tok = load_tokenizer(str(tiny_llama_chat))
    before, after = chat_frame(tok)
    pb, pa = perception_frame(tok)
    assert pb == before and pa[len(pa) - len(after):] == after
    assert pa[: len(pa) - len(after)] == tok(PERCEPTION_INSTRUCTION, add_special_tokens=False)["input_ids"]
