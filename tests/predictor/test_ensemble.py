"""LoRA-seed ensembles: shared frozen prefix, averaged members, load/serve/retrain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from predictor.config import TrainConfig
from predictor.ensemble import PredictorEnsemble, load_any, run_on_prefix, train_commands, write_ensemble
from predictor.model import collate, decoder_layers, load_predictor
from predictor.prefix_cache import prefix_states
from predictor.retrain import retrain
from predictor.service import PredictorService

from .conftest import save_member


@pytest.fixture()
def ensemble_dir(tiny_llama: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ens"
    save_member(tiny_llama, root / "seed0", 0)
    save_member(tiny_llama, root / "seed1", 1, n_heads=2)  # members may differ in their heads
    write_ensemble(root, ["seed0", "seed1"], ["make-ensemble seed0 seed1"])
    return root


BATCH = ([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23]], torch.tensor([7, 3, 400]))


def test_ensemble_averages_members_run_alone(ensemble_dir: Path) -> None:
    ens = load_any(ensemble_dir)
    assert isinstance(ens, PredictorEnsemble) and ens.k == 2
    alone = [load_predictor(ensemble_dir / m).eval() for m in ("seed0", "seed1")]
    ids, mask = collate(BATCH[0], 0)
    with torch.no_grad():
        got = torch.softmax(ens.eval()(ids, mask, BATCH[1]), -1)
        each = [torch.softmax(m(ids, mask, BATCH[1]), -1) for m in alone]
    # The shared prefix changes nothing: the mixture of the members run alone.
    assert torch.allclose(got, (each[0] + each[1]) / 2, atol=1e-5)
    assert not torch.allclose(each[0], each[1], atol=1e-3)  # the members do differ
    # The frozen layers are held once.
    l0, l1 = decoder_layers(ens.members[0].backbone), decoder_layers(ens.members[1].backbone)
    assert all(l0[j] is l1[j] for j in range(ens.k)) and l0[ens.k] is not l1[ens.k]
    # From cached prefix states, as evaluation runs it.
    with torch.no_grad():
        states = prefix_states(ens.backbone, ens.k, ids, mask)
        cached = torch.softmax(run_on_prefix(ens, ens.k, states, ids, mask, BATCH[1]), -1)
    assert torch.allclose(cached, got, atol=1e-5)
    with pytest.raises(ValueError, match="prefix"):
        run_on_prefix(ens, 1, states, ids, mask, BATCH[1])
    assert train_commands(ensemble_dir) == [
        "train --seed 0", "train --seed 1", "make-ensemble seed0 seed1"
    ]


def test_members_must_share_the_input_and_the_bins(tiny_llama: Path, tmp_path: Path) -> None:
    a = load_predictor(save_member(tiny_llama, tmp_path / "a", 0))
    b = load_predictor(save_member(tiny_llama, tmp_path / "b", 1, prompt_head=12))
    with pytest.raises(ValueError, match="prompt_head"):
        PredictorEnsemble([a, b])
    with pytest.raises(ValueError, match="without predictor_config.json"):
        write_ensemble(tmp_path, ["a", "missing"])


def test_service_serves_an_ensemble(ensemble_dir: Path) -> None:
    svc = PredictorService(ensemble_dir, padding_ratio=0.15, max_batch_size=4)  # LoRA merged
    unmerged = PredictorService(ensemble_dir, padding_ratio=0.15, merge_lora=False)
    prompts = ["write a poem about the sea", "hi", "explain quantum computing " * 20]
    served = svc.predict_lengths(prompts)
    assert all(abs(a - b) <= 1 for a, b in zip(served, unmerged.predict_lengths(prompts)))
    assert all(1 <= n <= 256 for n in served)
    assert svc.length_tokenizer is svc.tokenizer  # provenance read from the first member


def test_retrain_retrains_everysave_member(ensemble_dir: Path, tmp_path: Path) -> None:
    rows = [{"prompt": f"write {i} short lines about the sea", "output_len": 20 + 7 * (i % 9)} for i in range(40)]
    completions = tmp_path / "served.jsonl"
    completions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tc = TrainConfig(batch_size=8, max_steps=4, warmup_steps=0, eval_samples=4, checkpoint_every=0)
    out = tmp_path / "retrained"
    report = retrain(ensemble_dir, completions, out, tc, progress=False)
    again = load_any(out)
    assert isinstance(again, PredictorEnsemble) and len(again.members) == 2
    assert len(report["train_summary"]) == 2
    assert report["n_retrain"] + report["n_holdout"] == 40
    # Each member moved from where it started.
    for m in ("seed0", "seed1"):
        before = load_predictor(ensemble_dir / m).head.state_dict()
        after = load_predictor(out / m).head.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
